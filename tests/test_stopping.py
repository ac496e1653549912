"""Stop conditions: StopChecker on its own, and the engine's output under speculation.

The invariant: speculative decoding commits several tokens per step, but what the
request returns (tokens, finish reason, text cut) must be what plain decoding, which
commits one token per step, returns. So StopChecker must give the same result however
the token stream is chunked, and the engine with an always-accept drafter must give
the same result as the engine without a drafter.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from spec_helpers import ForwardingProposer, engine_for, make_prompts

from drafter_service.proposer import make_proposer
from orchestrator.engine import GenerationResult
from orchestrator.stats import RequestStats
from orchestrator.stopping import REPLACEMENT, IncrementalText, StopChecker, TextStream
from specmesh.sampling import SamplingParams

EOS = 13  # the unit tests' EOS id (the engine tests use the model's)


def toy_text(tok: int) -> str:
    """A toy detokeniser: tokens are 1-2 letter strings from a small alphabet, so stop strings
    often span token boundaries."""
    return "abcde"[tok % 5] * (1 + (tok // 5) % 2)


def decode(ids: list[int]) -> str:
    return "".join(toy_text(t) for t in ids)


def run_checker(tokens: list[int], chunks: list[int], sampling: SamplingParams, eos=(EOS,)):
    """Push ``tokens`` in chunks of the given sizes (until done); return what the request would return."""
    checker = StopChecker(sampling, eos, decode)
    emitted: list[int] = []
    pos = 0
    for size in chunks:
        if checker.done or pos >= len(tokens):
            break
        out = checker.push(tokens[pos : pos + size])
        assert out == checker.generated[len(emitted) :], "push must return exactly the newly generated tokens"
        emitted += out
        pos += size
    return emitted, checker.finish_reason, checker.text_limit


def one_at_a_time(tokens, sampling, eos=(EOS,)):
    return run_checker(tokens, [1] * len(tokens), sampling, eos)


# ----------------------------------------------------------- single conditions
def test_max_new_tokens_truncates_a_chunk():
    sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
    assert run_checker(list(range(10, 30)), [3, 4, 9], sp) == (list(range(10, 15)), "length", None)


def test_eos_stops_and_is_returned():
    sp = SamplingParams(max_new_tokens=50)
    toks = [7, 8, EOS, 9, 10]
    assert run_checker(toks, [5], sp) == ([7, 8, EOS], "stop", None)
    assert one_at_a_time(toks, sp) == ([7, 8, EOS], "stop", None)


def test_ignore_eos_generates_past_eos():
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    assert run_checker([7, EOS, 9, EOS, 11], [2, 3], sp) == ([7, EOS, 9, EOS], "length", None)


def test_stop_token_ids_stop_even_with_ignore_eos():
    sp = SamplingParams(max_new_tokens=50, ignore_eos=True, stop_token_ids=(9,))
    assert run_checker([7, EOS, 8, 9, 10], [5], sp) == ([7, EOS, 8, 9], "stop", None)


def test_stop_token_on_the_last_allowed_token_is_a_stop():
    sp = SamplingParams(max_new_tokens=3, stop_token_ids=(9,))
    assert run_checker([7, 8, 9, 10], [4], sp) == ([7, 8, 9], "stop", None)


def test_stop_string_sets_text_limit():
    sp = SamplingParams(max_new_tokens=50, stop=("cdd",))  # 2 -> "c", 8 -> "dd"
    toks = [0, 1, 2, 8, 4]
    text = decode(toks)
    assert one_at_a_time(toks, sp) == ([0, 1, 2, 8], "stop", text.index("cdd"))


def test_include_stop_str_in_output_cuts_after_the_stop_string():
    toks = [0, 1, 2, 8, 4]
    text = decode(toks)
    sp = SamplingParams(max_new_tokens=50, stop=("cdd", "cd"), include_stop_str_in_output=True)
    # both match at the same place: the longer one is the match, and the text keeps it
    assert one_at_a_time(toks, sp) == ([0, 1, 2, 8], "stop", text.index("cdd") + 3)
    assert run_checker(toks, [2, 3], sp) == one_at_a_time(toks, sp)
    spanning = SamplingParams(max_new_tokens=50, stop=("bcdd",), include_stop_str_in_output=True)
    assert run_checker(toks, [2, 2, 1], spanning) == ([0, 1, 2, 8], "stop", 1 + 4)


def test_stop_string_completed_mid_chunk_ends_generation_at_that_token():
    """A 4-token chunk whose 2nd token completes the stop string: the tokens after it are not generated."""
    sp = SamplingParams(max_new_tokens=50, stop=("cdd",))
    toks = [0, 1, 2, 8, 4, 5, 6]
    assert run_checker(toks, [2, 4, 1], sp) == one_at_a_time(toks, sp) == ([0, 1, 2, 8], "stop", 2)


def test_stop_string_and_stop_token_in_one_chunk():
    """The stop string completes before a stop token that comes later in the same chunk."""
    sp = SamplingParams(max_new_tokens=50, stop=("cdd",), stop_token_ids=(5,))
    toks = [0, 1, 2, 8, 4, 5, 6]
    assert run_checker(toks, [7], sp) == one_at_a_time(toks, sp) == ([0, 1, 2, 8], "stop", 2)


def test_stop_string_spanning_two_chunks():
    sp = SamplingParams(max_new_tokens=50, stop=("bcdd",))
    toks = [0, 1, 2, 8, 4]
    assert run_checker(toks, [2, 2, 1], sp) == ([0, 1, 2, 8], "stop", 1)  # "b" | "c" "dd": found across pushes


def test_stop_strings_need_a_decoder():
    with pytest.raises(ValueError):
        StopChecker(SamplingParams(stop=("x",)), (EOS,), None)


# ------------------------------------------------ chunking never changes the result
@settings(max_examples=400, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 14), min_size=1, max_size=30),
    chunks=st.lists(st.integers(1, 9), min_size=30, max_size=30),
    max_new=st.integers(1, 30),
    stop=st.lists(st.text("abcde", min_size=1, max_size=4), max_size=2),
    stop_ids=st.lists(st.integers(0, 14), max_size=2),
    ignore_eos=st.booleans(),
)
def test_chunked_pushes_equal_one_token_pushes(tokens, chunks, max_new, stop, stop_ids, ignore_eos):
    sp = SamplingParams(max_new_tokens=max_new, stop=tuple(stop), stop_token_ids=tuple(stop_ids), ignore_eos=ignore_eos)
    assert run_checker(tokens, chunks, sp) == one_at_a_time(tokens, sp)


# ---------------------------------------------------------------- the engine
MAX_NEW = 30
PROMPTS = make_prompts(6, seed=5)


def _spec_and_ar(model_sets, proposer="draft_model", **kw):
    ms = model_sets("random")
    target = ms.runner("target", "hf")
    spec = engine_for(target, proposer, 8, 8, draft_runner=ms.runner("same", "hf"), decode=decode, **kw)
    ar = engine_for(target, None, decode=decode, **kw)
    return spec, ar


def _summary(res):
    return res.token_ids, res.finish_reason, res.text_limit


def test_engine_stop_token_ids_truncate_accepted_tokens(model_sets, ar_reference):
    spec, ar = _spec_and_ar(model_sets)
    for prompt in PROMPTS:
        full = ar_reference("random", "hf", prompt, MAX_NEW)
        stop_tok = full[5]  # the 6th token: mid-way through the first 9-token speculative step
        sp = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(stop_tok,), ignore_eos=True)
        res = spec.generate(prompt, sp)
        assert _summary(res) == _summary(ar.generate(prompt, sp))
        assert res.token_ids == full[: full.index(stop_tok) + 1] and res.finish_reason == "stop"
        assert res.stats.num_generated == len(res.token_ids)
        assert [t for e in res.events for t in e.tokens] == res.token_ids  # nothing streamed past the stop


def test_engine_eos_of_the_model_stops_generation(model_sets, ar_reference):
    for prompt in PROMPTS:
        full = ar_reference("random", "hf", prompt, MAX_NEW)
        spec, ar = _spec_and_ar(model_sets)
        for engine in (spec, ar):  # pretend the model's EOS is a token it actually produces
            engine.verifier.info = dataclasses.replace(engine.verifier.info, eos_token_ids=(full[4],))
        sp = SamplingParams(max_new_tokens=MAX_NEW)
        res = spec.generate(prompt, sp)
        assert res.token_ids == full[: full.index(full[4]) + 1] and res.finish_reason == "stop"
        assert _summary(res) == _summary(ar.generate(prompt, sp))
        # ignore_eos: the full length
        assert spec.generate(prompt, dataclasses.replace(sp, ignore_eos=True)).token_ids == full


@pytest.mark.parametrize("proposer", ["draft_model", "draft_model_tree"])
def test_engine_stop_string_result_equals_plain_decoding(model_sets, ar_reference, proposer):
    spec, ar = _spec_and_ar(model_sets, proposer)
    stopped_mid_step = 0
    for prompt in PROMPTS:
        full = ar_reference("random", "hf", prompt, MAX_NEW)
        stop = decode(full[4:6])  # completes around the 6th token, inside the first speculative step
        sp = SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,), ignore_eos=True)
        want = ar.generate(prompt, sp)
        assert want.finish_reason == "stop" and decode(want.token_ids)[: want.text_limit].find(stop) == -1
        got = spec.generate(prompt, sp)
        stopped_mid_step += len(got.events) < len(want.events)
        assert _summary(got) == _summary(want), f"stop string {stop!r}"
        assert [t for e in got.events for t in e.tokens] == got.token_ids
    assert stopped_mid_step > 0


def test_engine_max_new_tokens_with_oversized_speculation(model_sets, ar_reference):
    spec, _ = _spec_and_ar(model_sets)
    for max_new in (1, 2, 3, 9, 10, 11):
        for prompt in PROMPTS[:3]:
            res = spec.generate(prompt, SamplingParams(max_new_tokens=max_new, ignore_eos=True))
            assert res.token_ids == ar_reference("random", "hf", prompt, MAX_NEW)[:max_new]
            assert res.finish_reason == "length" and res.stats.num_generated == max_new
            # the policy never drafts past the end: every step's tokens were all used
            assert sum(s.num_accepted + 1 for s in res.stats.steps) + 1 == max_new


@pytest.mark.parametrize("proposer", ["draft_model", None])
def test_streamed_text_never_shows_a_stop_string(model_sets, ar_reference, proposer):
    """Text streamed step by step (TextStream) equals the final cut text: nothing of the stop string
    leaks out before generation knows it matched."""
    spec, ar = _spec_and_ar(model_sets, proposer or "draft_model")
    engine = spec if proposer else ar
    for prompt in PROMPTS:
        full = ar_reference("random", "hf", prompt, MAX_NEW)
        stop = decode(full[7:10])
        sp = SamplingParams(max_new_tokens=MAX_NEW, stop=(stop,), ignore_eos=True)
        result = GenerationResult([], "", RequestStats())
        text = TextStream(decode, (stop,))
        pieces = [text.push(event.tokens, result.text_limit) for event in engine.stream(prompt, sp, result)]
        streamed = "".join(pieces)
        assert stop not in streamed
        assert streamed + text.flush(result.text_limit) == decode(result.token_ids)[: result.text_limit]


def test_text_stream_holds_back_nothing_without_stop_strings():
    text = TextStream(decode)
    assert text.push([0, 6], None) == "abb"
    assert text.push([2], None) == "c"
    assert text.flush(None) == ""


class _ReleaseRecorder(ForwardingProposer):
    """Records the context the drafter holds when its session closes (what learning proposers learn from)."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.at_release: list[list[int]] = []

    def release(self, state) -> None:
        self.at_release.append(list(state.tokens))
        self.inner.release(state)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_drafter_holds_exactly_the_emitted_tokens_at_close(model_sets, ar_reference, overlap):
    """A stop in the middle of a step commits tokens past it; the drafter is synced to what was emitted,
    not to what was committed (learning proposers must never learn text the user never got)."""
    ms = model_sets("random")
    target = ms.runner("target", "hf")
    recorder = _ReleaseRecorder(make_proposer("draft_model", draft_runner=ms.runner("same", "hf")))
    engine = engine_for(target, recorder, 8, 8)
    engine.overlap = overlap
    cut_mid_step = 0
    for prompt in PROMPTS:
        full = ar_reference("random", "hf", prompt, MAX_NEW)
        sp = SamplingParams(max_new_tokens=MAX_NEW, stop_token_ids=(full[5],), ignore_eos=True)
        res = engine.generate(prompt, sp)
        assert recorder.at_release[-1] == list(prompt) + res.token_ids
        committed = 1 + sum(s.num_accepted + 1 for s in res.stats.steps)
        cut_mid_step += committed > len(res.token_ids)
    assert cut_mid_step > 0  # the stop really cut a step short


# ------------------------------------------------------------ incremental detokenization
TEXT = ("def naïve_sum(xs):  # «Σ» of 数字 🙂\n    return sum(x for x in xs if x)\n\tprint('日本語', \"é\")  \n"
        "¿qué? — ok\n\n  trailing   spaces ")


def _pieces(decode, ids: list[int]) -> list[str]:
    text = IncrementalText(decode)
    pieces = [text.push(t) for t in ids]
    return [*pieces, text.flush()]


def _check_incremental(decode, ids: list[int]) -> None:
    """One token at a time: every prefix of the pieces is a prefix of the full decode, no piece holds half a
    character, and the pieces with the flush are the full decode."""
    full = decode(ids)
    pieces = _pieces(decode, ids)
    joined = ""
    for piece in pieces[:-1]:
        assert REPLACEMENT not in piece
        joined += piece
        assert full.startswith(joined)
    assert joined + pieces[-1] == full


def test_incremental_text_equals_the_full_decode_byte_level_bpe():
    from transformers import AutoTokenizer

    from specmesh.models import DEMO_DIR

    tok = AutoTokenizer.from_pretrained(DEMO_DIR / "target")
    ids = tok(TEXT).input_ids
    assert len(ids) > 40 and any(tok.decode(ids[:i]).endswith(REPLACEMENT) for i in range(len(ids)))  # split chars
    _check_incremental(lambda x: tok.decode(x, skip_special_tokens=True), ids)


def test_incremental_text_equals_the_full_decode_sentencepiece_style():
    """A Metaspace tokenizer (SentencePiece's convention: '▁' for a space, dropped at the start of a decode):
    a piece never loses its leading space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    corpus = [TEXT, "the quick brown fox jumps over the lazy dog", "return sum of the values"] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"]))
    ids = tok.encode("the quick fox: return sum of 数字 and the dog").ids
    decode = tok.decode
    # the convention: a token decoded alone loses the space the same token shows after others
    assert any(decode(ids[i : i + 1]) != decode(ids[: i + 1])[len(decode(ids[:i])) :] for i in range(1, len(ids)))
    _check_incremental(decode, ids)


def test_incremental_text_holds_an_incomplete_character_until_it_completes():
    """Bytes of one character in three tokens: nothing comes out until the third."""
    table = {0: b"a", 1: b"\xe6", 2: b"\x95", 3: b"\xb0", 4: b"b"}

    def decode(ids):
        return b"".join(table[i] for i in ids).decode("utf-8", errors="replace")

    text = IncrementalText(decode)
    assert [text.push(t) for t in (0, 1, 2, 3, 4)] == ["a", "", "", "数", "b"]
    text = IncrementalText(decode)
    assert [text.push(t) for t in (0, 1)] == ["a", ""] and text.flush() == REPLACEMENT  # as decode shows it


def test_stop_checker_decodes_each_token_once(monkeypatch):
    """O(1) decoding per token: the decoder is never asked for more than the newest few tokens."""
    longest = []

    def counting(ids):
        longest.append(len(ids))
        return decode(ids)

    checker = StopChecker(SamplingParams(max_new_tokens=2000, stop=("zz",), ignore_eos=True), (EOS,), counting)
    checker.push([i % 15 for i in range(1000)])
    assert len(checker.generated) == 1000 and max(longest) <= 2
