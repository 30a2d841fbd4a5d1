"""Op-aware planning: what one request's prefill computes, and how its rows are laid out.

A request's prefill runs as **one pass** (DESIGN.md §4): match the longest stored prefix;
decide which nodes must be computed (new nodes, the last token node for its logits, and any
emptied node whose KV is still visible to something computed or to the final view: that is
the one-pass restore); lay out pages. Keys that a repos re-encodes are written once per
position version by the same forward, or re-rotated from resident pages before it (pre-pass
copies). Decode rows are planned here too: one token, the request's final view plus its
generated pages.

Planning only reads node fields; every write goes through :class:`CacheManager`.
"""

from __future__ import annotations

import numpy as np

from akv_jax.cache.timeline import Timeline
from akv_jax.pallas.metadata import SegmentSpec, pages_with_a_slot
from akv_jax.serving.cache_manager import CacheManager
from akv_jax.serving.radix import Node
from akv_jax.serving.radix_keys import Op
from akv_jax.serving.work import NO_WRITE, Pass, RequestState


class PoolTooSmall(RuntimeError):
    """A request that can never fit the KV pool as its prefix is stored."""


def view_pieces(tl: Timeline, view: list[Node], seg_seen: np.ndarray, page_size: int,
                one_seg: np.ndarray) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per node of ``view`` (``one_seg``: its :func:`segments_of`), its pages and slot
    visibility for a reader that sees the tokens of the segments where ``seg_seen`` holds,
    without the pages that hold no visible slot; :func:`joined` makes them one layout, and
    a longer view that starts with this one extends them.

    Work per node, not per token: a token node lies in one segment, so it is wholly seen or
    unseen (one array lookup for the whole view). Nodes are page-aligned, so dropping pages
    node by node drops the same pages as over the whole view. An emptied node nothing here
    can see stands in as page 0 with every slot invisible (the planner guarantees nobody
    attends to it)."""
    hit = seg_seen[one_seg] & (one_seg >= 0)
    pages: list[np.ndarray] = []
    vis: list[np.ndarray] = []
    for v, seg, is_seen in zip(view, one_seg.tolist(), hit.tolist(), strict=True):
        if seg >= 0 and not is_seen:
            continue
        node_pages = (v.page_array() if v.pages is not None
                      else np.zeros(v.num_pages(page_size), np.int32))
        if seg >= 0:
            pages.append(node_pages)
            vis.append(v.slot_valid(page_size))
            continue
        toks = v.slot_tokens(page_size)
        ok = toks >= 0
        slots = np.zeros(len(toks), bool)
        slots[ok] = seg_seen[tl.token_seg[toks[ok]]]
        keep = pages_with_a_slot(slots.reshape(-1, page_size))
        pages.append(node_pages[keep])
        vis.append(slots.reshape(-1, page_size)[keep].reshape(-1))
    return pages, vis


def joined(pages: list[np.ndarray], vis: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """:func:`view_pieces` joined into one page list and one slot mask."""
    if not pages:
        return np.zeros(0, np.int32), np.zeros(0, bool)
    return np.concatenate(pages), np.concatenate(vis)


def segments_of(tl: Timeline, nodes: list[Node]) -> np.ndarray:
    """Per node, the one segment all of its tokens belong to, or -1 (a repos node, or a
    token node split at another request's message boundaries spanning several)."""
    span = [(v.tok_start, v.tok_start + len(v.key) - 1) if v.kind == "tokens" and len(v.key)
            else (-1, -1) for v in nodes]
    if not span:
        return np.zeros(0, np.int64)
    ends = np.asarray(span, np.int64).reshape(-1, 2)
    segs = tl.token_seg[ends]  # a -1 reads the last token: masked below
    return np.where((ends[:, 0] >= 0) & (segs[:, 0] == segs[:, 1]), segs[:, 0], -1)


def seen(tl: Timeline, nodes: list[Node], seg_seen: np.ndarray, one_seg: np.ndarray
         ) -> list[bool]:
    """Per node (``one_seg``: their :func:`segments_of`), whether a reader that sees the
    segments where ``seg_seen`` holds sees any of its tokens."""
    out = (seg_seen[one_seg] & (one_seg >= 0)).tolist()
    for i in np.flatnonzero(one_seg < 0).tolist():
        out[i] = bool(seg_seen[tl.token_seg[nodes[i].token_array()]].any())
    return out


def seen_until(tl: Timeline, nodes: list[Node], one_seg: np.ndarray) -> list[int]:
    """Per node (``one_seg``: their :func:`segments_of`), the last boundary before which
    any of its tokens is still attended (segment s sees it iff the value is >= s), -1 when
    it holds none."""
    out = tl.drop_boundary[one_seg].tolist()
    for i in np.flatnonzero(one_seg < 0).tolist():
        toks = nodes[i].token_array()
        out[i] = int(tl.drop_boundary[tl.token_seg[toks]].max()) if len(toks) else -1
    return out


def final_view(path: list[Node]) -> list[Node]:
    """The nodes a request's final version reads: the last repos node (its compact copy)
    and the token nodes after it, or every token node when there is no repos."""
    view: list[Node] = []
    for node in path:
        if node.kind == "tokens":
            view.append(node)
        elif node.kind == "repos":
            view = [node]
    return view


class Planner:
    def __init__(self, cache: CacheManager, canonical_layout: bool = False):
        """``canonical_layout``: continuations cut back to a page start (:meth:`page_aligned`),
        for kernels whose bits follow the layout (dispatch.layout_sets_bits)."""
        self.cache = cache
        self.canonical_layout = canonical_layout
        self.page_size = cache.page_size
        self.node_seg: dict[int, int] = {}  # the plan's path: node id -> its one segment or -1

    # ------------------------------------------------------------------ prefill
    def plan(self, r: RequestState, step: int, keep_used_after: float | None = None
             ) -> Pass | None:
        """Plan ``r``'s prefill pass, or None to retry next step (memory or dependencies).
        Raises :class:`PoolTooSmall` when it can never fit; whatever it raises, the cache
        is as before (the plan's changes are undone). ``keep_used_after``: its allocations
        may not evict live KV used since then that would be lost (admission's protection of
        active trajectories; see RadixTree.evict)."""
        cache = self.cache
        cache.begin_plan()
        try:
            p = self._plan(r, step, keep_used_after)
        except BaseException:
            cache.undo_plan()
            r.last_node = r.prompt_last_node = None
            r.view_nodes, r.view_pages, r.view_visible = [], None, None
            raise
        if p is None:
            cache.undo_plan()
        cache.end_plan()
        return p

    def _plan(self, r: RequestState, step: int, keep_used_after: float | None) -> Pass | None:
        cache = self.cache
        path, fresh = self.build_path(r)
        if any(n.busy_step == step or n.writer is not None for n in path):
            # Another request computes part of this path in this step, or in slices still to
            # run: its pages are not written yet (too late for this pass's pre-pass copies).
            return None
        # Each node's segment, once for the plan (every step below asks it of some nodes).
        self.node_seg = dict(zip((n.id for n in path), segments_of(r.tl, path).tolist(),
                                 strict=True))
        view = final_view(path)
        final = [v for v, ok in zip(view, seen(r.tl, view, r.tl.seg_active, self.segs(view)),
                                    strict=True) if ok]
        compute, needed = self.choose_compute(r, path, fresh, final)
        used = [n for n in path if n.id in compute or n.id in needed]
        # Needed KV that only the host tier holds is copied back, not recomputed.
        reload = [n for n in used if n.id not in compute and n.evicted]
        # pages_bound() counts a request's own segments, but a stored prefix split at other
        # requests' message boundaries can take more pages (a node each, page-aligned).
        holds = sum(cache.node_pages(n) for n in used if n.kind != "drop")
        holds += cache.pages_for(r.new_tokens_left)
        if holds > cache.num_pages:
            raise PoolTooSmall(
                f"this request needs {holds} KV pages at once (its prefix is stored split at "
                f"other requests' message boundaries); the pool has {cache.num_pages}: raise "
                "--max-total-tokens"
            )
        cache.hold(used, path[-1])
        to_alloc = [n for n in path if n.id in compute and n.pages is None]
        if not cache.alloc_nodes(to_alloc + reload, keep_used_after):
            return None
        cache.mark_writing([n for n in path if n.id in compute], r.rid)
        # Dispatched now, before this step's forwards and pre-pass copies read them.
        cache.reload(reload)
        p = self.lay_out(r, path, compute, final)
        p.written_pages = [pg for n in path if n.id in compute for pg in n.pages]
        p.restored_tokens = sum(n.num_tokens for n in to_alloc if n.id not in fresh)
        return p

    def build_path(self, r: RequestState) -> tuple[list[Node], set[int]]:
        """Matched nodes plus fresh nodes for the rest of the keys; ids of fresh nodes."""
        cache, tl, keys = self.cache, r.tl, r.keys
        path = cache.match(keys)
        if self.canonical_layout:
            path = self.page_aligned(path, tl)
        matched = sum(len(n.key) for n in path)  # keys consumed: tokens, and 1 per op item
        parent = path[-1] if path else cache.tree.root
        fresh: set[int] = set()
        for part in keys.parts:
            size = 1 if isinstance(part, Op) else part.end - part.start
            if matched >= size:
                matched -= size
                continue
            if isinstance(part, Op):
                held = ()
                if part.item[0] == "repos":  # it will hold copies of the tokens active there
                    held = tuple(tl.active_after(part.boundary).tolist())
                node = cache.add(parent, (part.item,), part.item[0], held_tokens=held)
                fresh.add(node.id)
                path.append(node)
                parent = node
                continue
            a, matched = part.start + matched, 0
            while a < part.end:
                # One node per segment: a rolling drop then empties whole nodes (a node that
                # also held the previous message's last token could never become dead).
                b = min(part.end, int(tl.seg_start[tl.token_seg[a] + 1]))
                node = cache.add(parent, keys.tokens[a:b], "tokens", a)
                fresh.add(node.id)
                path.append(node)
                parent = node
                a = b
        # The last prompt token's logits must be computed even on a full match; split a
        # resident last token node so that only its last page is recomputed.
        k = max(i for i, n in enumerate(path) if n.kind == "tokens")
        last = path[k]
        cut = ((len(last.key) - 1) // self.page_size) * self.page_size
        if last.id not in fresh and cut > 0:
            path[k : k + 1] = [cache.split(last, cut), last]
        return path, fresh

    def page_aligned(self, path: list[Node], tl: Timeline) -> list[Node]:
        """``path`` cut back to a page boundary where its last token node ends mid-page and
        mid-segment (an answer's decoded KV, whose last token has none, continued by the
        next turn): the rest of its last page is recomputed with the segment's remainder,
        so the segment lies in its pages as a prefill of the whole history lays it out, and
        so do the bits of kernels that sum a page at a time (the Pallas bodies). Costs up to
        a page less of cache hit a turn. (A stored node that spans several of this
        request's segments, cut by another request's messages, still lays them out its way.)"""
        if not path or path[-1].kind != "tokens":
            return path
        last, ps = path[-1], self.page_size
        end = last.tok_start + len(last.key)
        if (len(last.key) % ps == 0 or end >= tl.num_tokens
                or tl.token_seg[end] != tl.token_seg[end - 1]):
            return path
        keep = len(last.key) // ps * ps
        return path[:-1] + [self.cache.split(last, keep)] if keep else path[:-1]

    def segs(self, nodes: list[Node]) -> np.ndarray:
        """:func:`segments_of` ``nodes`` (all on the plan's path), from the plan's memo."""
        seg = self.node_seg
        return np.fromiter((seg[n.id] for n in nodes), np.int64, len(nodes))

    def choose_compute(
        self, r: RequestState, path: list[Node], fresh: set[int], final: list[Node]
    ) -> tuple[set[int], set[int]]:
        """``(compute, needed)``: nodes to compute (fresh ones, the last token node, and, to a
        fixpoint, every emptied node whose KV something computed, or the final view
        ``final``, still attends to) and the nodes whose KV the pass or the final view
        reads. A needed node with a host-tier copy is reloaded, not computed, so what it
        would have read is not needed for it."""
        tl = r.tl
        compute = {n.id for n in path if n.id in fresh and n.kind != "drop"}
        last_tok = next(n for n in reversed(path) if n.kind == "tokens")
        compute.add(last_tok.id)
        # Per node, once: the fixpoint below then compares integers instead of rescanning
        # every view per computed node.
        kv_nodes = [n for n in path if n.kind != "drop"]
        until = dict(zip((n.id for n in kv_nodes),
                         seen_until(tl, kv_nodes, self.segs(kv_nodes)), strict=True))
        while True:
            needed = {v.id for v in final}
            view: list[Node] = []
            for node in path:
                if node.kind == "tokens":
                    if node.id in compute:
                        s = int(tl.token_seg[node.tok_start])
                        needed |= {v.id for v in view if until[v.id] >= s}
                    view.append(node)
                elif node.kind == "repos":
                    if node.id in compute:
                        held = np.zeros(tl.num_tokens, bool)
                        held[node.token_array()] = True
                        needed |= {v.id for v in view if held[v.token_array()].any()}
                    view = [node]
            extra = {n.id for n in path if n.id in needed and n.gone} - compute
            if not extra:
                return compute, needed
            compute |= extra

    def lay_out(
        self, r: RequestState, path: list[Node], compute: set[int], final: list[Node]
    ) -> Pass:
        """The pass's rows, segments, writes and pre-pass copies; records ``r``'s final
        view (``final``: its nodes that the final version attends to)."""
        tl, ps = r.tl, self.page_size
        p = Pass()
        pass_row: dict[int, int] = {}  # abs token -> row in this pass
        # abs token -> (slot, pos) of its latest version: resident, or copied by this pass
        # (copy stage k re-rotates what stage k - 1 copied, as the forward chains versions);
        # None: written by the pass's forward.
        src: dict[int, tuple[int, int] | None] = {}
        stage = 0  # copy stage of the next computed repos node
        view: list[Node] = []
        # The view the last computed token node read: (it, its length then, what it saw,
        # its pieces). The final view usually starts with it, seen alike: extended, not redone.
        read: tuple[list[Node], int, np.ndarray, tuple[list, list]] | None = None
        epoch = 0
        cached = 0
        # Resident copies are only sources of a computed repos node's copies.
        copies_needed = any(n.kind == "repos" and n.id in compute for n in path)
        for node in path:
            if node.kind == "tokens":
                if node.pages is None or node.id not in compute and not copies_needed:
                    # Reused KV, or emptied and, by choose_compute, never read here (dropped
                    # before anything computed now could see it: served by the cache state,
                    # nothing recomputes it): either way cached.
                    cached += len(node.key)
                    view.append(node)
                    continue
                toks = node.token_ids()
                slots = _slots(node.pages, len(node.key), ps)
                if node.id in compute:
                    seg = int(tl.token_seg[node.tok_start])
                    seg_seen = tl.drop_boundary >= seg
                    pieces = view_pieces(tl, view, seg_seen, ps, self.segs(view))
                    read = (view, len(view), seg_seen, pieces)
                    pages, vis = joined(*pieces)
                    p.segments.append(
                        SegmentSpec(
                            q_start=len(p.tokens),
                            q_len=len(toks),
                            pages=np.concatenate([pages, np.asarray(node.pages, np.int32)]),
                            kv_visible=np.concatenate([vis, np.ones(len(toks), bool)]),
                            causal_pos=len(vis),
                        )
                    )
                    for t, tid, sl in zip(toks, node.key, slots, strict=True):
                        pass_row[t] = len(p.tokens)
                        p.tokens.append(tid)
                        p.q_pos.append(int(tl.append_pos[t]))
                        p.writes.append([(sl, int(tl.append_pos[t]))])
                    src.update({t: None for t in toks})
                else:
                    cached += len(toks)
                    pos = tl.version_pos[epoch]
                    src.update({t: (sl, int(pos[t])) for t, sl in zip(toks, slots, strict=True)})
                view.append(node)
            elif node.kind == "repos":
                epoch += 1
                held = node.held_tokens
                view = [node]
                if node.pages is None or not copies_needed:
                    # Emptied and unread (later versions come after it), or no copies to make.
                    # A later version the pass writes hops through this one's position.
                    for t in held if copies_needed else ():
                        if t in pass_row:
                            hop = (NO_WRITE, int(tl.version_pos[epoch][t]))
                            p.writes[pass_row[t]].append(hop)
                    src = {}
                    continue
                slots = _slots(node.pages, len(held), ps)
                pos = tl.version_pos[epoch]
                if node.id not in compute:
                    src = {t: (sl, int(pos[t])) for t, sl in zip(held, slots, strict=True)}
                    continue
                nxt: dict[int, tuple[int, int] | None] = {}
                for t, sl in zip(held, slots, strict=True):
                    new_pos = int(pos[t])
                    if src.get(t) is None and t in pass_row:
                        p.writes[pass_row[t]].append((sl, new_pos))
                        nxt[t] = None
                    else:
                        old_slot, old_pos = src[t]
                        p.copies.append((old_slot, sl, old_pos, new_pos, stage))
                        nxt[t] = (sl, new_pos)
                src, stage = nxt, stage + 1
        for ws in p.writes:  # hops that lead to no write
            while ws[-1][0] == NO_WRITE:
                ws.pop()
        last_tok = next(n for n in reversed(path) if n.kind == "tokens")
        p.logits_row = pass_row[last_tok.tok_start + len(last_tok.key) - 1]
        head_pages: list[np.ndarray] = []
        head_vis: list[np.ndarray] = []
        done = 0
        if read is not None:
            read_view, read_len, read_seen, read_pieces = read
            if read_view is view and np.array_equal(read_seen, tl.seg_active):
                (head_pages, head_vis), done = read_pieces, read_len
        more = view[done:]
        more_pages, more_vis = view_pieces(tl, more, tl.seg_active, ps, self.segs(more))
        r.view_pages, r.view_visible = joined(head_pages + more_pages, head_vis + more_vis)
        r.view_nodes = final
        r.last_node = path[-1]
        r.prompt_last_node = path[-1]
        r.cached_tokens = cached
        return p

    # ------------------------------------------------------------------ decode
    def decode_pass(self, r: RequestState) -> Pass | None:
        """``r``'s next decode pass: one row for the token sampled last, or a row for each
        token still unfed (a grammar's forced tokens after it, fed in one pass); None when
        no page is free for them."""
        ps = self.page_size
        n = r.unfed
        j = len(r.generated) - n - r.gen_base  # index of the first token fed, in gen_pages
        last = j + n - 1
        while last // ps >= len(r.gen_pages):
            pages = self.cache.alloc(1)
            if pages is None:
                return None
            r.gen_pages.extend(pages)
        tl = r.tl
        gen_vis = np.arange(len(r.gen_pages) * ps) <= last
        pos = [tl.next_pos + j + i for i in range(n)]
        slots = _slots(r.gen_pages, j + n, ps)[j:]
        return Pass(
            tokens=r.generated[len(r.generated) - n :],
            q_pos=pos,
            writes=[[(sl, p)] for sl, p in zip(slots, pos, strict=True)],
            segments=[
                SegmentSpec(
                    q_start=0,
                    q_len=n,
                    pages=np.concatenate([r.view_pages, np.asarray(r.gen_pages, np.int32)]),
                    kv_visible=np.concatenate([r.view_visible, gen_vis]),
                    causal_pos=len(r.view_visible) + j,
                )
            ],
            logits_row=n - 1,
        )


def _slots(pages: list[int], n: int, page_size: int) -> list[int]:
    return [pages[i // page_size] * page_size + i % page_size for i in range(n)]
