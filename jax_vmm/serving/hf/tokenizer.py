"""Text <-> token ids with a checkpoint's `tokenizer.json` (the `tokenizers` library).

Encoding applies the file's post-processor, so BOS is added exactly when the checkpoint's
tokenizer adds it (Llama: yes, Qwen2: no), as transformers' fast tokenizers do with
`add_special_tokens=True`. Decoding skips special tokens; ids the tokenizer does not know
(a model vocabulary may be larger than the tokenizer's) decode to nothing, as in
transformers.
"""

from __future__ import annotations

from pathlib import Path

from .._optional import require
from .config import CheckpointError

TOKENIZER_FILE = "tokenizer.json"


class TextTokenizer:
    """A loaded tokenizer.json. Thread-safety: that of `tokenizers.Tokenizer` (its encode
    and decode may be called from several threads)."""

    def __init__(self, path: str | Path) -> None:
        tokenizers = require("tokenizers", "reading tokenizer.json (text prompts)")
        self.path = Path(path)
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(self.path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            raise CheckpointError(f"{self.path}: not a readable tokenizer.json ({e})") from None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """special_tokens=False: no BOS (a conversation's later turn, which continues a
        sequence that has one)."""
        return list(self._tok.encode(text, add_special_tokens=special_tokens).ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path) -> TextTokenizer | None:
    """The checkpoint's tokenizer, or None when it has no tokenizer.json (token-id
    prompts still work)."""
    path = Path(model_dir) / TOKENIZER_FILE
    if path.exists() and not path.is_file():
        raise CheckpointError(f"{path}: not a file (a tokenizer.json was expected there)")
    return TextTokenizer(path) if path.is_file() else None
