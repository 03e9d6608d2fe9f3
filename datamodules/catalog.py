"""The corpora by name: ``data.name`` -> a factory of the ``Corpus``.

Register a new corpus by adding a factory to ``CORPORA`` and the ``DataConfig`` options it reads to
``CORPUS_OPTIONS`` (the others are refused: ``ignored_data_options``). This module sits above every corpus module
(``corpora``, ``hub``, ``probe``), so none of them needs to import another to be listed.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

from datamodules import hub
from datamodules.corpora import Corpus, DataError, EmbeddedCorpus, TextFilesCorpus
from datamodules.probe import TASKS as PROBE_TASKS, ProbeCorpus

CorpusFactory = Callable[..., Corpus]

CORPORA: Dict[str, CorpusFactory] = {
    "embedded": lambda **kw: EmbeddedCorpus(),
    "text": lambda path=None, **kw: TextFilesCorpus(path or [], kw.get("text_key", "text")),
    "openwebtext": hub.openwebtext,
    "slimpajama": hub.slimpajama,
}
#: The ``DataConfig`` options that reach each corpus (the others are refused by ``ignored_data_options``).
_HUB_OPTIONS = ("path", "hub_id", "revision", "streaming", "max_tokens", "num_proc")
# num_proc: the processes of the token cache build, which every tokenised corpus goes through (not the probes')
CORPUS_OPTIONS: Dict[str, Tuple[str, ...]] = {"embedded": ("num_proc",), "text": ("path", "num_proc"),
                                              "openwebtext": _HUB_OPTIONS, "slimpajama": _HUB_OPTIONS}
CORPUS_SPECIFIC = _HUB_OPTIONS  # options some corpus reads and others ignore

for _task in PROBE_TASKS:  # every probe name the generator module defines, so a new version needs no edit here
    CORPORA[_task] = lambda _task=_task, **options: ProbeCorpus(_task, options.get("max_tokens"))
    CORPUS_OPTIONS[_task] = ("max_tokens",)  # generated: the number of episodes


# the generated probe data are byte ids: only the ``bytes`` tokenizer reads them (experiments.run checks it up
# front; datamodules.probe.byte_ids refuses any other when the data are generated, after the Trainer is built)
REQUIRED_TOKENIZER: Dict[str, str] = {name: ProbeCorpus.default_tokenizer for name in CORPORA
                                      if name.split("/")[0].startswith("probe")}


def corpus_names() -> List[str]:
    return sorted(CORPORA)


def get_corpus(name: str, **options) -> Corpus:
    if name not in CORPORA:
        raise DataError(f"data.name: unknown dataset {name!r}; valid datasets: {', '.join(corpus_names())}")
    return CORPORA[name](**options)


def ignored_data_options(name: str, options: Dict[str, object]) -> List[Tuple[str, List[str]]]:
    """``(option, datasets that read it)`` for each corpus-specific option set (not None / False / empty)
    that dataset ``name`` would silently ignore, e.g. ``path`` for the generated probe data."""
    read = CORPUS_OPTIONS.get(name, CORPUS_SPECIFIC)
    return [(option, [n for n in corpus_names() if option in CORPUS_OPTIONS.get(n, CORPUS_SPECIFIC)])
            for option in CORPUS_SPECIFIC
            if option not in read and options.get(option) not in (None, False, [], (), "")]
