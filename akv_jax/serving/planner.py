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
from akv_jax.pallas.metadata import SegmentSpec
from akv_jax.serving.cache_manager import CacheManager
from akv_jax.serving.radix import Node, Op
from akv_jax.serving.work import Pass, RequestState


class PoolTooSmall(RuntimeError):
    """A request that can never fit the KV pool as its prefix is stored."""


def visible(tl: Timeline, toks: np.ndarray, seg: int) -> np.ndarray:
    """Which of the absolute tokens ``toks`` (-1: padding) segment ``seg`` attends to."""
    ok = toks >= 0
    out = np.zeros(len(toks), bool)
    out[ok] = tl.drop_boundary[tl.token_seg[toks[ok]]] >= seg
    return out


def visible_pages(pages: list[int], vis: np.ndarray, page_size: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """A view without its pages that hold no visible slot: ``(pages, slot visibility)``,
    the slots of the pages kept, in order. Attention skips nothing it would have read (an
    invisible slot contributes nothing), and a step over a history that dropped most of
    its tokens reads, and its metadata holds, only the pages still attended."""
    slots = np.zeros((len(pages), page_size), bool)
    slots.reshape(-1)[: len(vis)] = vis
    keep = slots.any(axis=1)
    return np.asarray(pages, np.int32)[keep], slots[keep].reshape(-1)


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
    def __init__(self, cache: CacheManager):
        self.cache = cache
        self.page_size = cache.page_size

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
        final = [v for v in final_view(path) if r.tl.final_active[v.token_array()].any()]
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
        # Per node, once: the last boundary before which any of its tokens is still attended
        # (segment s sees node v iff reach[v] >= s), and its tokens; the fixpoint below then
        # compares integers instead of rescanning every view per computed node.
        toks = {n.id: n.token_array() for n in path if n.kind != "drop"}
        reach = {
            i: int(tl.drop_boundary[tl.token_seg[t]].max()) if len(t) else -1
            for i, t in toks.items()
        }
        while True:
            needed = {v.id for v in final}
            view: list[Node] = []
            for node in path:
                if node.kind == "tokens":
                    if node.id in compute:
                        s = int(tl.token_seg[node.tok_start])
                        needed |= {v.id for v in view if reach[v.id] >= s}
                    view.append(node)
                elif node.kind == "repos":
                    if node.id in compute:
                        held = np.zeros(tl.num_tokens, bool)
                        held[toks[node.id]] = True
                        needed |= {v.id for v in view if held[toks[v.id]].any()}
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
        src: dict[int, tuple[int, int]] = {}  # abs token -> (slot, pos) of a resident copy
        view: list[Node] = []
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
                    view_toks = self._view_tokens(view)
                    pages, vis = visible_pages(self._view_pages(view),
                                               visible(tl, view_toks, seg), ps)
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
                    src = {}
                    continue
                slots = _slots(node.pages, len(held), ps)
                if node.id in compute:
                    for t, sl in zip(held, slots, strict=True):
                        new_pos = int(tl.version_pos[epoch][t])
                        if src.get(t) is None and t in pass_row:
                            p.writes[pass_row[t]].append((sl, new_pos))
                        else:
                            old_slot, old_pos = src[t]
                            p.copies.append((old_slot, sl, old_pos, new_pos))
                # Later copies start from this version only when it is resident already;
                # otherwise they keep using the older resident copy or the pass's write.
                if node.id not in compute:
                    pos = tl.version_pos[epoch]
                    src = {t: (sl, int(pos[t])) for t, sl in zip(held, slots, strict=True)}
                else:
                    src = {t: src.get(t) for t in held}
        last_tok = next(n for n in reversed(path) if n.kind == "tokens")
        p.logits_row = pass_row[last_tok.tok_start + len(last_tok.key) - 1]
        view_toks = self._view_tokens(view)
        vis = view_toks >= 0
        vis[vis] = tl.final_active[view_toks[vis]]
        r.view_pages, r.view_visible = visible_pages(self._view_pages(view), vis, ps)
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

    # ------------------------------------------------------------------ helpers
    def _view_tokens(self, view: list[Node]) -> np.ndarray:
        """Absolute token index held in each slot of the view's pages (-1 for padding)."""
        if not view:
            return np.zeros(0, np.int64)
        return np.concatenate([v.slot_tokens(self.page_size) for v in view])

    def _view_pages(self, view: list[Node]) -> list[int]:
        """Pages of a view; an emptied node nothing here can see stands in as page 0 with
        every slot invisible (the planner guarantees nobody attends to it)."""
        out: list[int] = []
        for v in view:
            out += v.pages if v.pages is not None else [0] * self.cache.node_pages(v)
        return out


def _slots(pages: list[int], n: int, page_size: int) -> list[int]:
    return [pages[i // page_size] * page_size + i % page_size for i in range(n)]
