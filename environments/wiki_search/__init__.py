"""wiki-search: answer a question by searching a folder of documents with tools.

The model gets a question and two tools: ``search(query)``, BM25 ranking (the ``bm25s``
library) over the passages of every document, which returns the best passage of each of the
top documents; and ``read_document(doc_id, page)``, which returns a document page by page. It
searches and reads as many times as it needs (``max_turns`` model calls in all), then answers
in plain text, ending with ``Answer: <short answer>``.

The corpus is a folder of ``.md`` / ``.txt`` files (a document's id is its path inside the
folder without the suffix; its title is its first ``# `` heading, else the file name); the
packaged one holds twelve encyclopedia-style articles. ``docs_dir`` swaps it for the user's own
folder, with questions from ``tasks_file`` (default: ``tasks.jsonl`` in that folder), one JSON
object a line: ``id``, ``question``, ``answer``, ``aliases`` (other accepted answers) and
``docs`` (the ids of the documents that hold the answer; checked at load).

Rewards: ``correct`` (1 when an accepted answer, normalised as in SQuAD: case, punctuation and
articles ignored, appears in a short final answer, else 0); metrics ``exact`` (the final
answer is exactly an accepted one), ``f1`` (token overlap with the best accepted answer),
``read_source`` (the share of the answer's documents the model read or saw in search results)
and ``num_searches``. The tools record ``searches`` (queries), ``seen`` (ids search showed) and
``read`` (ids read) in the rollout's state. No reference answer: an answer without the searches that find it
teaches the model to guess.
"""

from __future__ import annotations

import re
import string
import unicodedata
from collections import Counter
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

from flywheel.sdk.environment import Environment, EnvironmentLoadError, Metric, Reward, TaskSet
from flywheel.sdk.harness import ChatHarness, RolloutContext, Tool, ToolError

SYSTEM_PROMPT = """Answer the user's question using the document collection. Use the tools:
search(query) finds the passages that best match a few keywords and gives each document's id;
read_document(doc_id, page) reads a document. Search again with other words when the results miss.
Base your answer on what the documents say. When you know it, reply without a tool call and end
with a last line of the form `Answer: <short answer>` (a name, a number or a few words)."""

DOC_SUFFIXES = (".md", ".txt")
PASSAGE_CHARS = 800  # passages are paragraphs merged up to about this size
PAGE_CHARS = 3000
SNIPPET_CHARS = 320
TASK_SCHEMA = {"id": str, "question": str, "answer": str, "aliases": list, "docs": list}


# --- the corpus -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


def read_corpus(folder: Path) -> dict[str, Document]:
    if not folder.is_dir():
        raise EnvironmentLoadError(f"wiki_search: docs_dir={str(folder)!r} is not a folder")
    docs = {}
    for path in sorted(p for p in folder.rglob("*") if p.suffix in DOC_SUFFIXES and p.is_file()):
        text = path.read_text(errors="replace").strip()
        if not text:
            continue
        doc_id = path.relative_to(folder).with_suffix("").as_posix()
        first = text.splitlines()[0]
        title = first[2:].strip() if first.startswith("# ") else path.stem.replace("_", " ")
        docs[doc_id] = Document(doc_id, title, text)
    if not docs:
        raise EnvironmentLoadError(f"wiki_search: no non-empty {' or '.join(DOC_SUFFIXES)} files in {folder}")
    return docs


def passages(doc: Document) -> list[str]:
    """The document's paragraphs, merged while they stay under PASSAGE_CHARS (long ones kept whole)."""
    out: list[str] = []
    for paragraph in (p.strip() for p in re.split(r"\n\s*\n", doc.text)):
        if not paragraph:
            continue
        if out and len(out[-1]) + len(paragraph) < PASSAGE_CHARS:
            out[-1] += "\n\n" + paragraph
        else:
            out.append(paragraph)
    return out


class Library:
    """A corpus with its BM25 index; its ``search`` and ``read_document`` methods are the tools."""

    def __init__(self, docs: dict[str, Document], top_k: int = 5) -> None:
        import bm25s
        from bm25s.tokenization import Tokenizer

        self.docs = docs
        self.top_k = top_k
        self._passages = [(doc.doc_id, text) for doc in docs.values() for text in passages(doc)]
        # The title goes with every passage: it is often what a query names.
        indexed = [f"{docs[doc_id].title}\n{text}" for doc_id, text in self._passages]
        self._tokenizer = Tokenizer(stopwords="en")
        self._index = bm25s.BM25()
        self._index.index(self._tokenizer.tokenize(indexed, return_as="ids", show_progress=False),
                          show_progress=False)

    def ranked(self, query: str) -> list[tuple[str, str, float]]:
        """(doc id, best passage, score) of the top documents for ``query``, best first."""
        tokens = self._tokenizer.tokenize([query], update_vocab=False, return_as="ids", show_progress=False)
        hits, scores = self._index.retrieve(tokens, k=len(self._passages), show_progress=False)
        best: dict[str, tuple[str, float]] = {}
        for i, score in zip(hits[0], scores[0], strict=True):
            doc_id, text = self._passages[int(i)]
            if score > 0 and doc_id not in best:
                best[doc_id] = (text, float(score))
        return [(doc_id, text, score) for doc_id, (text, score) in list(best.items())[:self.top_k]]

    def search(self, query: str, ctx: RolloutContext) -> str:
        """Search the documents with a few keywords (e.g. 'Danube source Black Forest'); returns the
        best-matching documents: id, title and the passage that matched."""
        if not query.strip():
            raise ToolError("the query is empty: give a few keywords")
        ctx.state.setdefault("searches", []).append(query)
        results = self.ranked(query)
        if not results:
            return f"No document matches {query!r}. Try other keywords."
        ctx.state.setdefault("seen", [])
        lines = []
        for n, (doc_id, text, score) in enumerate(results, 1):
            if doc_id not in ctx.state["seen"]:
                ctx.state["seen"].append(doc_id)
            snippet = " ".join(text.split())
            snippet = snippet if len(snippet) <= SNIPPET_CHARS else snippet[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " ..."
            lines.append(f"{n}. [{doc_id}] {self.docs[doc_id].title} (score {score:.2f})\n   {snippet}")
        return "\n".join(lines)

    def read_document(self, doc_id: str, ctx: RolloutContext, page: int = 1) -> str:
        """Read a document by its id (from search results), one page of about 3000 characters at a time."""
        doc = self.docs.get(doc_id.strip().strip("[]"))
        if doc is None:
            raise ToolError(f"no document {doc_id!r}; use an id shown in brackets by search, e.g. "
                            f"{next(iter(self.docs))!r}")
        num_pages = max(1, -(-len(doc.text) // PAGE_CHARS))
        if not 1 <= page <= num_pages:
            raise ToolError(f"{doc.doc_id!r} has {num_pages} page(s); page={page} is out of range")
        read = ctx.state.setdefault("read", [])
        if doc.doc_id not in read:
            read.append(doc.doc_id)
        text = doc.text[(page - 1) * PAGE_CHARS:page * PAGE_CHARS]
        more = f"\n\n[page {page} of {num_pages}; read page {page + 1} for more]" if page < num_pages else ""
        return f"[{doc.doc_id}] page {page} of {num_pages}\n\n{text}{more}"


# --- answers ----------------------------------------------------------------------------------


def final_answer(completion: str) -> str:
    """The text after the last ``Answer:`` (to the end of that line), else the whole reply."""
    found = re.findall(r"answer\s*:\s*(.+)", completion, re.IGNORECASE)
    return (found[-1] if found else completion).strip()


def normalize(text: str) -> str:
    """SQuAD-style: lowercase, accents, punctuation and articles dropped; 8,849 and 8849 the same."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode().lower()
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # thousands separators
    text = re.sub(r"(?<=\d)\.(?=\d)", "\0", text)  # decimal points survive punctuation removal
    text = text.translate(str.maketrans(string.punctuation, " " * len(string.punctuation))).replace("\0", ".")
    return " ".join(w for w in text.split() if w not in ("a", "an", "the"))


def accepted(task: dict) -> list[str]:
    return [a for a in (normalize(x) for x in [task["answer"], *task.get("aliases", [])]) if a]


def _contains(words: list[str], phrase: list[str]) -> bool:
    return any(words[i:i + len(phrase)] == phrase for i in range(len(words) - len(phrase) + 1))


def correct(completion: str, task: dict) -> float:
    """1.0 when an accepted answer appears in a final answer at most five words longer than it."""
    words = normalize(final_answer(completion)).split()
    return float(any(_contains(words, a.split()) and len(words) <= len(a.split()) + 5 for a in accepted(task)))


def exact(completion: str, task: dict) -> float:
    return float(normalize(final_answer(completion)) in accepted(task))


def f1(completion: str, task: dict) -> float:
    predicted = normalize(final_answer(completion)).split()
    best = 0.0
    for answer in accepted(task):
        gold = answer.split()
        common = sum((Counter(predicted) & Counter(gold)).values())
        if common:
            precision, recall = common / len(predicted), common / len(gold)
            best = max(best, 2 * precision * recall / (precision + recall))
    return best


def read_source(state: dict, task: dict) -> float:
    found = set(state.get("read", [])) | set(state.get("seen", []))
    return sum(d in found for d in task["docs"]) / len(task["docs"]) if task["docs"] else 0.0


def num_searches(state: dict) -> float:
    return float(len(state.get("searches", [])))


def load_environment(docs_dir: str | None = None, tasks_file: str | None = None, top_k: int = 5,
                     max_turns: int = 10) -> Environment:
    """``docs_dir``: a folder of .md/.txt documents (default: the packaged articles);
    ``tasks_file``: questions about them (default: ``tasks.jsonl`` beside the packaged articles,
    or inside ``docs_dir``); ``top_k``: documents per search; ``max_turns``: model calls."""
    here = Path(str(files(__name__)))
    folder = Path(docs_dir) if docs_dir else here / "docs"
    if tasks_file is None:
        tasks_file = str(folder / "tasks.jsonl" if docs_dir else here / "tasks.jsonl")
        if not Path(tasks_file).is_file():
            raise EnvironmentLoadError(f"wiki_search: no tasks_file given and no tasks.jsonl in {folder}; give "
                                       f"the questions about your documents")
    library = Library(read_corpus(folder), top_k=top_k)
    tasks = TaskSet.from_jsonl(tasks_file, schema=TASK_SCHEMA)
    for row in tasks.rows(tasks.size or 0):
        missing = [d for d in row["docs"] if d not in library.docs]
        if missing:
            raise EnvironmentLoadError(f"wiki_search: task {row['id']!r} in {tasks_file} names documents {missing} "
                                       f"that {folder} does not hold")
    return Environment(
        name="wiki_search",
        tasks=tasks,
        harness=ChatHarness(system_prompt=SYSTEM_PROMPT, max_turns=max_turns,
                            tools=[Tool(library.search), Tool(library.read_document)]),
        prompt=lambda task: task["question"],
        rewards=[Reward(correct), Metric(exact), Metric(f1), Metric(read_source), Metric(num_searches)],
        sampling={"temperature": 1.0, "max_tokens": 1024},
        version="0.1.0",
        description=__doc__.split("\n\n")[0],
    )

