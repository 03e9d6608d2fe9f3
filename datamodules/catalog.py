"""The corpora by name: ``data.name`` -> a factory of the ``Corpus``.

Register a new corpus by adding a factory to ``CORPORA``. This module sits above every corpus module
(``corpora``, ``hub``, ``probe``), so none of them needs to import another to be listed.
"""
from __future__ import annotations

from typing import Callable, Dict, List

from datamodules import hub
from datamodules.corpora import Corpus, DataError, EmbeddedCorpus, TextFilesCorpus
from datamodules.probe import ProbeCorpus

CorpusFactory = Callable[..., Corpus]

CORPORA: Dict[str, CorpusFactory] = {
    "embedded": lambda **kw: EmbeddedCorpus(),
    "text": lambda path=None, **kw: TextFilesCorpus(path or [], kw.get("text_key", "text")),
    "openwebtext": hub.openwebtext,
    "slimpajama": hub.slimpajama,
}
for _task in ("probe", "probe/arith", "probe/recall", "probe/text",
              "probe-v2", "probe-v2/arith", "probe-v2/recall", "probe-v2/text"):
    CORPORA[_task] = lambda _task=_task, **options: ProbeCorpus(_task, options.get("max_tokens"))


def corpus_names() -> List[str]:
    return sorted(CORPORA)


def get_corpus(name: str, **options) -> Corpus:
    if name not in CORPORA:
        raise DataError(f"data.name: unknown dataset {name!r}; valid datasets: {', '.join(corpus_names())}")
    return CORPORA[name](**options)
