"""The byte-level tokenizer of the shipped tiny models: token ``i < 256`` is byte ``i``; then
``BOS``, ``EOS`` and ``PAD``. No vocabulary file, no dependency."""

from __future__ import annotations

BOS, EOS, PAD = 256, 257, 258
VOCAB_SIZE = 260  # 256 bytes + 3 specials, one spare


class ByteTokenizer:
    """``encode(text) -> [BOS, b_0, b_1, ...]``; ``decode`` drops specials, replaces bad UTF-8."""

    vocab_size = VOCAB_SIZE
    bos_token_id = BOS
    eos_token_id = EOS

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        return ([BOS] if bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")
