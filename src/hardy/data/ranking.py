"""Ranking collections: the bundled WikiText-2 section-retrieval collection, and any collection in the
BEIR layout (corpus.jsonl, queries.jsonl, qrels/<split>.tsv) or with TREC qrels.

The WikiText-2 collection is built from the test split's article structure, which is human-written:
passages are each article's paragraphs cut into windows of at most `MAX_WORDS` words at sentence
ends; a query is an article's title and one of its level-2 section headings ("Title — Section");
a passage is graded 2 for its own section, 1 for the rest of its article, 0 otherwise (implicit).
Queries split into dev and test by article (a hash of the title), so a tuned choice (the
interpolation weight) never sees a test article. WikiText-2 test is evaluation-only in hardy: no
training or calibration default reads it, and a test checks none of these passages occurs in the
corpora that do.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from hardy.data.text import read_text
from hardy.errors import HardyError
from hardy.fsio import atomic_directory, write_bytes_atomic, write_json_atomic

WIKITEXT_VERSION = "wikitext2-sections/1"
MAX_WORDS = 100  # a passage: at most this many words (one longer sentence is cut at the limit)
MIN_WORDS = 3  # shorter windows (list fragments, lone numbers) are not passages
DEV_SHARE = 3  # one article in three (by title hash) is dev; the rest is the held-out test split
SPLITS = ("dev", "test")

_HEADING = re.compile(r"^((?:= )+)(?!=)(.*?)((?: =)+)$")  # "= = Section = =": level 2
# WikiText's tokenized release: " @-@ " joins, spaces before punctuation, split possessives.
_DETOK = [(re.compile(r" @(.)@ "), r"\1"), (re.compile(r" ([.,;:!?)\]'])"), r"\1"), (re.compile(r"([(\[]) "), r"\1"),
          (re.compile(r" n't\b"), "n't")]


@dataclass(frozen=True)
class Passage:
    id: str
    title: str
    text: str

    def content(self) -> str:
        """What a ranker reads: the title, then the text (the BEIR convention for titled corpora)."""
        return f"{self.title}: {self.text}" if self.title else self.text


@dataclass(frozen=True)
class Query:
    id: str
    text: str
    split: str = "test"


@dataclass
class Collection:
    name: str
    passages: list[Passage]
    queries: list[Query]
    qrels: dict[str, dict[str, int]]  # query id -> passage id -> grade (> 0; unjudged = 0)
    meta: dict = field(default_factory=dict)

    def split(self, name: str) -> "Collection":
        """The queries (and their judgements) of one split; every passage stays a candidate."""
        queries = [q for q in self.queries if q.split == name]
        if not queries:
            have = sorted({q.split for q in self.queries})
            raise HardyError(f"collection {self.name} has no queries in split {name!r} (it has: {', '.join(have)})")
        return Collection(self.name, self.passages, queries, {q.id: self.qrels.get(q.id, {}) for q in queries},
                          dict(self.meta, split=name))

    def stats(self) -> dict:
        return {"passages": len(self.passages), "queries": len(self.queries),
                "queries_by_split": {s: sum(q.split == s for q in self.queries) for s in sorted({q.split for q in self.queries})},
                "judged_pairs": sum(len(j) for j in self.qrels.values()),
                "judged_by_grade": {g: sum(v == g for j in self.qrels.values() for v in j.values())
                                    for g in sorted({v for j in self.qrels.values() for v in j.values()})}}


def detokenize(line: str) -> str:
    for pattern, repl in _DETOK:
        line = pattern.sub(repl, line)
    return line.strip()


def _windows(paragraph: str) -> list[str]:
    """Sentences packed greedily into windows of at most MAX_WORDS words."""
    sentences = [s for s in re.split(r"(?<=[.!?]) ", paragraph) if s]
    out, words = [], []
    for sentence in sentences:
        sw = sentence.split()
        if words and len(words) + len(sw) > MAX_WORDS:
            out.append(" ".join(words))
            words = []
        words += sw
        while len(words) > MAX_WORDS:
            out.append(" ".join(words[:MAX_WORDS]))
            words = words[MAX_WORDS:]
    if words:
        out.append(" ".join(words))
    return out


def _split_of(title: str) -> str:
    return "dev" if int(hashlib.sha256(title.encode()).hexdigest(), 16) % DEV_SHARE == 0 else "test"


def build_wikitext_collection(text: str, source: str = "wikitext2-test") -> Collection:
    """The section-retrieval collection of a WikiText file (see the module docstring). Deterministic:
    the same text gives the same ids, passages, queries and judgements."""
    articles: list[dict] = []
    lines = text.split("\n")
    for i, raw in enumerate(lines):
        line = raw.strip()
        if not line:
            continue
        m = _HEADING.match(line)
        # A heading stands between blank lines; "= ... =" inside running text (formulas) is text.
        alone = (i == 0 or not lines[i - 1].strip()) and (i + 1 == len(lines) or not lines[i + 1].strip())
        if m and alone and m.group(1).count("=") == m.group(3).count("="):
            level, heading = m.group(1).count("="), detokenize(m.group(2))
            if level == 1:
                articles.append({"title": heading, "sections": [], "paragraphs": []})
            elif level == 2 and articles:
                articles[-1]["sections"].append(heading)
            continue  # deeper headings stay inside their level-2 section
        if articles:
            section = len(articles[-1]["sections"]) - 1  # -1: the lead, before any section
            articles[-1]["paragraphs"].append((section, detokenize(line)))
    if not articles:
        raise HardyError(f"{source}: no WikiText article headings (' = Title = ') found")

    passages, queries, qrels = [], [], {}
    for a, art in enumerate(articles):
        by_section: dict[int, list[str]] = {}
        article_ids = []
        for section, paragraph in art["paragraphs"]:
            for window in (w for w in _windows(paragraph) if len(w.split()) >= MIN_WORDS):
                pid = f"a{a:03d}p{len(article_ids):03d}"
                passages.append(Passage(pid, art["title"], window))
                article_ids.append(pid)
                by_section.setdefault(section, []).append(pid)
        split = _split_of(art["title"])
        for s, heading in enumerate(art["sections"]):
            own = by_section.get(s)
            if not own or not heading.replace("<unk>", "").strip(" ,.;:-–"):
                continue  # a heading with no text of its own, or one WikiText replaced by <unk>
            qid = f"a{a:03d}s{s:02d}"
            queries.append(Query(qid, f"{art['title']} — {heading}", split))
            grades = {pid: 1 for pid in article_ids}
            grades.update({pid: 2 for pid in own})
            qrels[qid] = grades
    meta = {"version": WIKITEXT_VERSION, "source": source, "source_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "max_words": MAX_WORDS, "min_words": MIN_WORDS, "articles": len(articles)}
    return Collection("wikitext2-sections", passages, queries, qrels, meta)


def bundled_collection() -> Collection:
    return build_wikitext_collection(read_text("wikitext2-test"), "wikitext2-test")


def _jsonl(rows) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows).encode()


def collection_files(coll: Collection) -> dict[str, bytes]:
    """The collection in the BEIR layout, file name -> bytes."""
    files = {"corpus.jsonl": _jsonl({"_id": p.id, "title": p.title, "text": p.text} for p in coll.passages),
             "queries.jsonl": _jsonl({"_id": q.id, "text": q.text, "metadata": {"split": q.split}}
                                     for q in coll.queries)}
    for split in sorted({q.split for q in coll.queries}):
        lines = ["query-id\tcorpus-id\tscore"] + [f"{q.id}\t{pid}\t{g}" for q in coll.queries if q.split == split
                                                  for pid, g in sorted(coll.qrels.get(q.id, {}).items())]
        files[f"qrels/{split}.tsv"] = ("\n".join(lines) + "\n").encode()
    return files


def write_collection(coll: Collection, out: str | Path) -> dict:
    """Write the BEIR layout to a new directory `out`, with collection.json (version, counts, each
    file's SHA-256) written last as the completion marker; returns that manifest."""
    files = collection_files(coll)
    manifest = dict(coll.meta, name=coll.name, **coll.stats(),
                    sha256={name: hashlib.sha256(data).hexdigest() for name, data in files.items()})
    with atomic_directory(out) as tmp:
        (tmp / "qrels").mkdir()
        for name, data in files.items():
            write_bytes_atomic(tmp / name, data)
        write_json_atomic(tmp / "collection.json", manifest)
    return manifest


def _read_jsonl(path: Path, required: tuple[str, ...]) -> list[dict]:
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise HardyError(f"cannot read {path}: {e}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise HardyError(f"{path}:{n}: not JSON ({e.msg})") from None
        if not isinstance(row, dict) or any(not isinstance(row.get(k), str) for k in required):
            raise HardyError(f"{path}:{n}: expected an object with string fields {', '.join(required)}")
        rows.append(row)
    return rows


def _read_qrels(path: Path) -> dict[str, dict[str, int]]:
    """BEIR TSV (query-id, corpus-id, score; a header line) or TREC qrels (qid iter docid rel)."""
    qrels: dict[str, dict[str, int]] = {}
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        parts = line.split()
        if not parts or (n == 1 and parts[0] == "query-id"):
            continue
        if len(parts) not in (3, 4):
            raise HardyError(f"{path}:{n}: expected 'query-id corpus-id score' or 'qid 0 docid rel'")
        qid, pid, grade = (parts[0], parts[1], parts[2]) if len(parts) == 3 else (parts[0], parts[2], parts[3])
        try:
            value = int(grade)
        except ValueError:
            raise HardyError(f"{path}:{n}: relevance {grade!r} is not an integer") from None
        if value > 0:
            qrels.setdefault(qid, {})[pid] = value
    return qrels


def read_collection(spec: str) -> Collection:
    """`wikitext2` (the bundled collection, built in memory) or a directory in the BEIR layout: every
    qrels/<split>.tsv names a split; a query without judgements in any split is dropped."""
    if spec in ("wikitext2", "wikitext2-sections"):
        return bundled_collection()
    root = Path(spec)
    if not root.is_dir():
        raise HardyError(f"collection not found: {spec} (give 'wikitext2' or a directory with corpus.jsonl, "
                         "queries.jsonl and qrels/<split>.tsv)")
    for name in ("corpus.jsonl", "queries.jsonl"):
        if not (root / name).is_file():
            raise HardyError(f"{root}: missing {name}")
    qrel_files = sorted((root / "qrels").glob("*.tsv")) + sorted((root / "qrels").glob("*.txt"))
    if not qrel_files:
        raise HardyError(f"{root}: no qrels/<split>.tsv files")
    passages = [Passage(r["_id"], r.get("title") if isinstance(r.get("title"), str) else "", r["text"])
                for r in _read_jsonl(root / "corpus.jsonl", ("_id", "text"))]
    known = {p.id for p in passages}
    if len(known) != len(passages):
        raise HardyError(f"{root}/corpus.jsonl: duplicate passage ids")
    texts = {r["_id"]: r["text"] for r in _read_jsonl(root / "queries.jsonl", ("_id", "text"))}
    queries, qrels = [], {}
    for path in qrel_files:
        for qid, judged in _read_qrels(path).items():
            if qid not in texts:
                raise HardyError(f"{path}: query {qid!r} is not in queries.jsonl")
            unknown = sorted(set(judged) - known)
            if unknown:
                raise HardyError(f"{path}: passage {unknown[0]!r} (query {qid!r}) is not in corpus.jsonl")
            if qid in qrels:
                raise HardyError(f"{path}: query {qid!r} is judged in two splits")
            queries.append(Query(qid, texts[qid], path.stem))
            qrels[qid] = judged
    meta = {}
    if (root / "collection.json").is_file():
        meta = json.loads((root / "collection.json").read_text())
    return Collection(meta.get("name", root.name), passages, queries, qrels, meta)
