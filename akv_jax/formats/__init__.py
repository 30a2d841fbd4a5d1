"""Per-family parsers of generated replies into content, reasoning and tool calls."""
