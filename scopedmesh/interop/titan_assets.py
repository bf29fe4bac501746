"""A word-level tokenizer and a small text set in ``c4_test``'s format, for torchtitan
on a machine without torchtitan's source tree (its wheel ships neither).

torchtitan's debug configs read ``./tests/assets/tokenizer`` and the ``c4_test``
set from its repository; :func:`write_assets` writes stand-ins that its
``HuggingFaceTokenizer`` and ``HuggingFaceTextDataLoader`` read::

    tokenizer, dataset = write_assets("assets")
    # --hf_assets_path assets/tokenizer --dataloader.dataset_path assets/c4_test
"""

from __future__ import annotations

import importlib
import json
import random
from pathlib import Path
from typing import Any

__all__ = ["write_assets"]


def write_assets(
    folder: str | Path, *, words: int = 1000, documents: int = 2000, seed: int = 0
) -> tuple[Path, Path]:
    """Write ``folder/tokenizer`` (``words`` words, under the debug model's 2048-token
    vocabulary) and ``folder/c4_test`` (``documents`` texts of 20 to 60 words, drawn
    from ``seed``); returns both paths."""
    tokenizers: Any = importlib.import_module("tokenizers")  # torchtitan's dependency
    Tokenizer, models, pre_tokenizers = (
        tokenizers.Tokenizer,
        tokenizers.models,
        tokenizers.pre_tokenizers,
    )

    for value, name in ((words, "words"), (documents, "documents")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    root = Path(folder)
    rng = random.Random(seed)
    names = [f"w{i}" for i in range(words)]
    vocab = {w: i for i, w in enumerate(["<unk>", "<|begin_of_text|>", "<|end_of_text|>", *names])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    (root / "tokenizer").mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(root / "tokenizer" / "tokenizer.json"))
    special = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"}
    (root / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(special))
    (root / "c4_test").mkdir(exist_ok=True)
    with open(root / "c4_test" / "c4-train.json", "w") as out:
        for _ in range(documents):
            text = " ".join(rng.choice(names) for _ in range(rng.randint(20, 60)))
            out.write(json.dumps({"text": text}) + "\n")
    return root / "tokenizer", root / "c4_test"
