"""Serving side: memory manager, speculative decoding, engine (see DESIGN.md section 5)."""
