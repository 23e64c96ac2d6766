"""Data preparation on a real corpus with planted noise, and the loader's sharding and resume."""
from __future__ import annotations

import json
import random

import numpy as np
import pytest

from hardy.data.clean import CleanConfig, normalize, rejection_reason
from hardy.data.loader import PackedLoader
from hardy.data.prepare import load_index, load_split, prepare
from hardy.data.text import read_text
from hardy.errors import HardyError


def shingle_jaccard(a: str, b: str, n: int = 5) -> float:
    """Independent reference: Jaccard similarity of word 5-gram sets."""
    def grams(s):
        w = s.lower().split()
        return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}
    ga, gb = grams(a), grams(b)
    return len(ga & gb) / len(ga | gb)


def variant(doc: str, target: float, rng: random.Random) -> str:
    """Replace trailing words until the 5-gram Jaccard with `doc` drops to about `target`."""
    words = doc.split()
    for k in range(1, len(words)):
        new = words[:len(words) - k] + [f"zq{rng.randrange(10**6)}" for _ in range(k)]
        if shingle_jaccard(doc, " ".join(new)) <= target:
            return " ".join(new)
    raise AssertionError("could not build the variant")


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    rng = random.Random(0)
    text = read_text("wikitext2-valid")[:300_000]
    paragraphs = [p.strip() for p in text.split("\n \n") if len(p.split()) > 120]
    base = paragraphs[5]
    near90, near50 = variant(base, 0.9, rng), variant(paragraphs[8], 0.5, rng)
    noise = {
        "binary": "".join(chr(rng.choice([0, 1, 2, 7, 8, 0xFFFD, 0x80 + rng.randrange(30)])) for _ in range(200)),
        # words of symbols, so that it is the symbol filter that removes it, not the too-short one
        "symbols": " ".join("".join(rng.choice("#$%^&*()[]{}<>|~=+-_/\\@!") for _ in range(5)) for _ in range(24)),
        "one_token": "Ostrich",
        "repeated": "\n".join(["Buy the best deals now at our store"] * 50),
    }
    planted_docs = [base, near90, paragraphs[8], near50, paragraphs[12], *noise.values()]
    corpus = text + "\n\n" + "\n\n".join(planted_docs) + "\n\n" + paragraphs[12] + "\n"
    root = tmp_path_factory.mktemp("prep")
    src = root / "corpus.txt"
    src.write_bytes(corpus.encode("utf-8") + b"\n\n\xff\xfe\x00garbage\x80\x81 bytes\n")
    report = prepare([str(src)], "bpe:1000", root / "out", seed=0)
    (root / "text.txt").write_text(text + "\n")
    return {"root": root / "out", "report": report, "text": root / "text.txt", "near90": near90, "near50": near50, "base": base,
            "noise": noise, "j90": shingle_jaccard(base, near90), "j50": shingle_jaccard(paragraphs[8], near50)}


def kept_text(out) -> str:
    from hardy.formats.tokenizer import HardyTokenizer

    tok = HardyTokenizer.from_hf_dir(out)
    ids = [int(i) for split in ("train", "val") for i in load_split(out, split)]
    return tok.decode(ids)


def test_planted_near_duplicates(planted):
    assert 0.86 <= planted["j90"] <= 0.9 and 0.45 <= planted["j50"] <= 0.5
    removed = planted["report"].removed
    assert removed["near duplicate (Jaccard >= 0.8)"] >= 1
    text = kept_text(planted["root"])
    assert normalize(planted["near90"]) not in text  # 0.9 similar: removed
    assert normalize(planted["near50"]) in text  # 0.5 similar: kept
    assert normalize(planted["base"]) in text  # the first occurrence stays


def test_planted_exact_duplicates_and_noise(planted):
    removed = planted["report"].removed
    assert removed["exact duplicate"] >= 1
    assert removed["binary/control characters"] >= 2  # planted control characters and raw invalid bytes
    assert removed["symbol-heavy"] >= 1
    assert removed["too short"] >= 1
    assert removed["repetitive"] >= 1
    text = kept_text(planted["root"])
    for noise in planted["noise"].values():
        assert normalize(noise) not in text
    assert "garbage" not in text


def test_each_filter_removes_exactly_what_was_planted(planted, tmp_path):
    """Against the same text without the planted documents: each filter's count grows by exactly the
    documents planted for it, and no other count moves."""
    from hardy.data.prepare import select_documents

    baseline, _ = select_documents([str(planted["text"])], tmp_path, CleanConfig(), 0.8, 0.05, 0, False)
    grew = {k: v - baseline.removed[k] for k, v in planted["report"].removed.items()}
    assert grew == {
        "exact duplicate": 4,  # paragraphs 5, 8 and 12 repeated, paragraph 12 twice
        "near duplicate (Jaccard >= 0.8)": 1,  # the 0.9-similar variant, not the 0.5 one
        "binary/control characters": 2,  # planted control characters and the raw invalid bytes
        "symbol-heavy": 1, "too short": 1, "repetitive": 1, "too long": 0,
    }, grew


def test_clean_text_is_kept(planted):
    report = planted["report"]
    assert report.chars_kept >= 0.9 * report.chars_in
    index = load_index(planted["root"])
    assert index["splits"]["train"]["tokens"] > 50_000 and index["splits"]["val"]["tokens"] > 0
    assert json.loads((planted["root"] / "tokenizer_config.json").read_text())["hardy_pre_tokenizer"] == "gpt-2"


def test_filters_one_by_one():
    cfg = CleanConfig()
    assert rejection_reason("A perfectly ordinary sentence about the history of Rome.", cfg) is None
    assert rejection_reason("word", cfg) == "too short"
    assert rejection_reason("%$#@ !!! ### @@@ ^^^ &&& ***", cfg) == "symbol-heavy"
    assert rejection_reason("spam and eggs " * 30, cfg) == "repetitive"
    assert rejection_reason("x" * 10 + " a b c " + "\x00" * 5, cfg) == "binary/control characters"
    assert rejection_reason("word " * 30_000, CleanConfig(max_dup_ngram_ratio=1.0)) == "too long"


def test_prepare_refuses_bad_input(tmp_path):
    with pytest.raises(HardyError, match="not found"):
        prepare([str(tmp_path / "missing.txt")], "bpe:500", tmp_path / "o")
    with pytest.raises(HardyError, match="bpe:VOCAB"):
        (tmp_path / "t.txt").write_text("hello there my friend\n\nanother paragraph of text\n")
        prepare([str(tmp_path / "t.txt")], "bpe:lots", tmp_path / "o2")


def batches(loader, n):
    return [tuple(t.clone() for t in loader.next_batch()) for _ in range(n)]


def test_loader_resume_yields_exactly_the_same_batches():
    tokens = np.arange(10_000, dtype=np.uint16)
    a = PackedLoader(tokens, seq_len=32, micro_batch=4, grad_accum=2, dp_rank=1, dp_size=2, seed=7)
    first = batches(a, 50)  # crosses an epoch boundary (312 samples / 8 per step)
    state = json.loads(json.dumps(a.state_dict()))  # as stored in a checkpoint
    rest = batches(a, 120)
    b = PackedLoader(tokens, seq_len=32, micro_batch=4, grad_accum=2, dp_rank=1, dp_size=2, seed=7)
    b.load_state_dict(state)
    resumed = batches(b, 120)
    assert all(x[0].equal(y[0]) and x[1].equal(y[1]) for x, y in zip(rest, resumed))
    assert not first[0][0].equal(rest[0][0])
    with pytest.raises(HardyError, match="sample stream changed .*seed: 7 -> 8"):
        PackedLoader(tokens, seq_len=32, micro_batch=4, grad_accum=2, dp_size=2, seed=8).load_state_dict(state)
    with pytest.raises(HardyError, match="seq_len: 32 -> 16"):
        PackedLoader(tokens, seq_len=16, micro_batch=4, grad_accum=2, dp_size=2, seed=7).load_state_dict(state)


@pytest.mark.parametrize("before,after", [((4, 1, 2), (2, 2, 2)), ((2, 1, 4), (4, 1, 4)), ((4, 1, 2), (2, 1, 2)),
                                          ((2, 2, 3), (3, 1, 1))])
def test_loader_resumed_on_another_layout_repeats_and_skips_nothing(before, after):
    """(processes, grad_accum, micro_batch) before and after a resume, the global batch kept or not: the
    samples all ranks take form one gapless, duplicate-free run of the stream, across epochs."""
    tokens = np.arange(4_000, dtype=np.uint16)  # 124 samples of 32 + 1: several epochs below

    def ranks(dp, accum, mb):
        return [PackedLoader(tokens, seq_len=32, micro_batch=mb, grad_accum=accum, dp_rank=r, dp_size=dp, seed=3)
                for r in range(dp)]

    def take(loaders, steps):
        seen = []
        for _ in range(steps):
            for loader in loaders:
                seen += [q for m in range(loader.grad_accum) for q in loader.sample_ids(m)]
                for _ in range(loader.grad_accum):
                    loader.next_rows()
        return seen

    first = ranks(*before)
    seen = take(first, 7)
    state = json.loads(json.dumps(first[0].state_dict()))  # every rank's position is the same
    assert all(loader.state_dict() == state for loader in first)
    second = ranks(*after)
    for loader in second:
        loader.load_state_dict(state)
    seen += take(second, 20)
    assert sorted(seen) == list(range(len(seen))) and len(seen) > 124
    # a sample id is a slot of an epoch's permutation: the rows are that slot's tokens
    probe = second[0]
    epoch, slot = divmod(probe.sample_ids()[0], probe.n_samples)
    assert probe.next_rows()[0, 0] == probe._permutation(epoch)[slot] * 32


def test_loader_positions_saved_per_rank_before_they_were_global_still_resume():
    tokens = np.arange(10_000, dtype=np.uint16)
    old = {"consumed": 6, "seq_len": 32, "micro_batch": 4, "grad_accum": 2, "dp_size": 2, "n_samples": 312, "seed": 7}
    loader = PackedLoader(tokens, seq_len=32, micro_batch=4, grad_accum=2, dp_size=2, seed=7)
    loader.load_state_dict(old)
    assert loader.position() == 6 * 2 * 4 and loader.sample_ids() == [48, 49, 50, 51]


def test_loader_targets_are_shifted_inputs_and_ranks_are_disjoint():
    tokens = np.arange(5_000, dtype=np.uint16)
    ranks = [PackedLoader(tokens, seq_len=16, micro_batch=2, dp_rank=r, dp_size=2, seed=1) for r in range(2)]
    single = PackedLoader(tokens, seq_len=16, micro_batch=2, grad_accum=2, seed=1)
    for _ in range(20):
        (x0, y0), (x1, y1) = ranks[0].next_batch(), ranks[1].next_batch()
        assert x0[:, 1:].equal(y0[:, :-1])
        assert not set(x0[:, 0].tolist()) & set(x1[:, 0].tolist())
        # dp = 2 sees, per optimizer step, exactly what dp = 1 with 2 accumulation steps sees
        s0, s1 = single.next_batch()[0], single.next_batch()[0]
        assert x0.equal(s0) and x1.equal(s1)


@pytest.mark.parametrize("block", [1, 5, 64, 1 << 22])
def test_streamed_documents_equal_those_of_the_whole_text(tmp_path, monkeypatch, block):
    """Blocks cut anywhere (inside a UTF-8 sequence, a \\r\\n, a blank line): the same documents, characters
    and undecodable bytes as splitting the whole decoded text at once."""
    from hardy.data import prepare as P
    from hardy.data.clean import split_documents

    raw = ("First line\r\nsecond  line\u00a0here\r\n\r\nnext doc é ü\n \t\nthird\rline\r\r"
           "a\u2003b\n\n\n\ncafe\u0301 end").encode("utf-8") + b"\xff\xfe tail\x80\n\n" + "last".encode("utf-8")
    path = tmp_path / "t.txt"
    path.write_bytes(raw)
    monkeypatch.setattr(P, "READ_BLOCK", block)
    stats = {"chars": 0, "bad": 0}
    streamed = list(P.stream_documents([str(path)], stats))
    text = raw.decode("utf-8", errors="replace")
    assert streamed == split_documents(normalize(text))
    assert stats == {"chars": len(text), "bad": text.count("\ufffd")} and len(streamed) == 6


def test_prepare_holds_no_more_memory_for_eight_times_the_text(tmp_path):
    """Streaming: prepare's peak RSS over its start-up is about the same for 2,500 documents of 150 and of
    1,200 words (3 MB and 25 MB of text): nothing holds the corpus; what grows with the corpus is the
    de-duplication index, per document (README: hardy data prepare). Every document survives into the shards."""
    import subprocess
    import sys

    words = read_text("wikitext2-valid").split()
    rng = random.Random(1)
    probe = ("import resource, sys\nfrom hardy.data.prepare import prepare\n"
             "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
             "r = prepare([sys.argv[1]], 'smollm2', sys.argv[2], val_fraction=0.01)\n"
             "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base, r.documents, r.kept, r.chars_in)")
    peaks = []
    for n_words in (150, 1200):
        path = tmp_path / f"c{n_words}.txt"
        path.write_text("".join(" ".join(rng.choice(words) for _ in range(n_words)) + "\n\n" for _ in range(2500)))
        out = subprocess.run([sys.executable, "-c", probe, str(path), str(tmp_path / f"o{n_words}")],
                             capture_output=True, text=True, check=True).stdout.split()
        growth_kb, documents, kept, chars = map(int, out)
        assert kept == documents == 2500 and chars >= n_words * 2500 * 4
        peaks.append(growth_kb)
    assert peaks[1] < peaks[0] + 12 * 1024, peaks  # the extra 22 MB of text, held, would show in full


def test_the_per_distinct_character_counts_equal_the_character_loops():
    from hardy.data.clean import _bad_char, bad_chars, symbol_chars

    rng = random.Random(3)
    alphabet = [chr(i) for i in range(160)] + list("éü—’“”\ufffd\ue000\u0378\u2028\u00a0") + ["\U0001f600"]
    for _ in range(300):
        doc = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 200)))
        assert bad_chars(doc) == sum(_bad_char(c) for c in doc)
        assert symbol_chars(doc) == sum(1 for c in doc if not (c.isalnum() or c.isspace()))


def test_the_loader_reads_samples_without_holding_the_split(tmp_path):
    """A 256 MB split in 4 shards, sampled all over by the packed loader: RSS grows by the samples read,
    not by the pages touched (a memory map would keep them), and a slice across a shard boundary is
    the concatenation of both shards' tokens."""
    import psutil

    from hardy.data.prepare import write_token_dataset

    tokens = np.arange(128 << 20, dtype=np.uint32).astype(np.uint16)  # 256 MB of uint16
    write_token_dataset(tmp_path / "ds", {"train": (tokens, 1), "val": (tokens[:10], 1)}, 50_000, 0, "test", 0,
                        shard_tokens=32 << 20)
    del tokens
    split = load_split(tmp_path / "ds", "train")
    assert len(split) == 128 << 20 and len(load_index(tmp_path / "ds")["splits"]["train"]["shards"]) == 4
    edge = 32 << 20
    assert split[edge - 3:edge + 3].tolist() == [(edge + i) % 65536 for i in range(-3, 3)]
    loader = PackedLoader(split, seq_len=1024, micro_batch=8, seed=0)
    before = psutil.Process().memory_info().rss
    for _ in range(2000):  # 16,000 samples of 2 KB from a 256 MB split: 32 MB read, pages all over it
        loader.next_rows()
    assert psutil.Process().memory_info().rss - before < 24 << 20


def test_the_compact_lsh_index_decides_as_datasketchs_own_storage_in_a_fraction_of_its_memory():
    import random
    import tracemalloc
    import zlib

    import numpy as np
    from datasketch import MinHash, MinHashLSH

    from hardy.data.dedup import NearDuplicateIndex, shingles

    rng = random.Random(0)
    words = [f"w{i}" for i in range(3000)]
    docs = [" ".join(rng.choice(words) for _ in range(80)) for _ in range(1500)]
    for i in range(0, 1500, 10):  # near copies: a few words replaced (Jaccard ~0.85-0.95), and exact ones
        w = docs[i].split()
        docs.append(" ".join(w[:-2] + ["x1", "x2"]) if i % 20 else docs[i])
    rng.shuffle(docs)

    reference = MinHashLSH(threshold=0.8, num_perm=128)  # datasketch's dict-of-sets storage
    signatures, expected = [], []
    for doc in docs:
        m = MinHash(num_perm=128, seed=0, hashfunc=zlib.crc32)
        m.update_batch(shingles(doc))
        dup = any(np.count_nonzero(signatures[j] == m.hashvalues) >= 0.8 * 128 for j in reference.query(m))
        expected.append(dup)
        if not dup:
            reference.insert(len(signatures), m, check_duplication=False)
            signatures.append(m.hashvalues)
    index = NearDuplicateIndex()
    tracemalloc.start()
    got = [index.is_duplicate_or_add(doc) for doc in docs]
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    index.close()
    assert got == expected and 100 <= sum(got) <= 150  # the same documents dropped, the planted copies
    kept = len(docs) - sum(got)
    assert held / kept < 800, held / kept  # bytes per kept document (datasketch's own storage: ~3,400)
