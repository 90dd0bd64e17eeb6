"""Libraries a worker imports once, on its main thread, before its task and engine threads start.

transformers resolves its names lazily, on first use, and two threads doing that at once can see a
half-made module: a plan task importing xgrammar (which imports transformers' tokenizer classes)
while the preload thread loaded a tokenizer failed with "cannot import name
'PreTrainedTokenizerBase' from 'transformers'", and the job it was planning never started.
"""

from __future__ import annotations


def import_shared_libraries() -> None:
    import transformers
    import xgrammar  # noqa: F401 - imported for its side effect: transformers' tokenizer classes resolved

    for name in ("AutoTokenizer", "PreTrainedTokenizerBase", "PreTrainedTokenizerFast", "GenerationConfig"):
        getattr(transformers, name)
