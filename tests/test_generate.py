"""The generation loop: stop strings (also across token boundaries), max_tokens, end-of-generation tokens, a
full context, streaming deltas that add up to the decoded text; then end to end on the default model.

Most tests drive the loop with a scripted runtime (it makes the model "say" a given token sequence through
one-hot logits, and checks it is fed the way the Runtime contract says) and the real tokenizer of the
default model.
"""

from __future__ import annotations

import numpy as np
import pytest

from strata_async.default_model import build_default_model
from strata_async.generate import StopMatcher, generate
from strata_async.io import open_gguf
from strata_async.sampling import SamplingParams
from strata_async.tokenizer import Tokenizer

RNG = np.random.default_rng()
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def default_file(tmp_path_factory):
    return build_default_model(tmp_path_factory.mktemp("default") / "default.gguf")


@pytest.fixture(scope="module")
def tokenizer(default_file):
    with open_gguf(default_file) as f:
        return Tokenizer.from_gguf(f)


class ScriptedRuntime:
    """Runtime stand-in whose greedy continuation of any prompt is `script`, token by token."""

    def __init__(self, script: list[int], vocab: int, max_context: int = 4096):
        self.script = list(script)
        self.vocab = vocab
        self.max_context = max_context
        self.calls: list[tuple[list[int], bool]] = []

    def new_state(self) -> dict:
        return {"position": 0}

    def forward(self, state: dict, token_ids: np.ndarray, all_logits: bool = True) -> np.ndarray:
        ids = [int(t) for t in token_ids]
        self.calls.append((ids, all_logits))
        if len(self.calls) > 1:  # a decode step feeds back exactly the token produced before
            assert ids == [self.script[len(self.calls) - 2]]
        state["position"] += len(ids)
        assert state["position"] <= self.max_context
        step = len(self.calls) - 1
        logits = RNG.standard_normal((1, self.vocab)).astype(np.float32)
        logits[0, self.script[step]] = 100.0
        return logits


def run(tokenizer, script, prompt=(1, 2, 3), **kwargs):
    runtime = ScriptedRuntime(script + [0] * 8, tokenizer.vocab_size, kwargs.pop("max_context", 4096))
    kwargs.setdefault("sampling", GREEDY)
    events = list(generate(runtime, tokenizer, list(prompt), **kwargs))
    return events, runtime


def text_of(events) -> str:
    return "".join(e.text for e in events)


def random_text(n_words: int) -> str:
    words = ["the", "model", " of", "world", "é", "日本", "🙂", "a", " ", "\n", "layer", "x", "123", "ab"]
    return "".join(RNG.choice(words) for _ in range(n_words))


def test_deltas_concatenate_to_decoded_text(tokenizer):
    for _ in range(5):
        script = tokenizer.encode(random_text(30), add_special=False)
        events, runtime = run(tokenizer, script, max_tokens=len(script))
        assert [e.token_id for e in events[:-1]] == script
        assert text_of(events) == tokenizer.decode(script, skip_special=True)
        assert "\ufffd" not in text_of(events)  # multi-byte characters are never cut between deltas
        closing = events[-1]
        assert closing.token_id is None and closing.finish_reason == "length"
        assert runtime.calls[0] == ([1, 2, 3], False)  # prefill: the prompt, last logits only
        assert all(len(ids) == 1 and not full for ids, full in runtime.calls[1:])
        assert len(runtime.calls) == len(script)  # the last token is not fed back


def test_stop_string_across_token_boundaries(tokenizer):
    for _ in range(20):
        text = random_text(40)
        script = tokenizer.encode(text, add_special=False)
        full = tokenizer.decode(script)
        start = int(RNG.integers(0, len(full) - 4))
        stop = full[start : start + int(RNG.integers(2, 6))]
        other = "never-appears-" + stop  # a longer stop string sharing the prefix must not confuse matching
        events, _ = run(tokenizer, script, max_tokens=len(script) + 5, stop=[other, stop])
        first = full.find(stop)
        assert text_of(events) == full[:first]
        assert events[-1].finish_reason == "stop"
        released = ""
        for e in events:
            released += e.text
            assert stop not in released
            assert full.startswith(released)


def test_stop_string_spelled_by_several_tokens(tokenizer):
    script = tokenizer.encode("one two three four", add_special=False)
    pieces = [tokenizer.decode([t]) for t in script]
    assert len(pieces) >= 4
    stop = pieces[1][-1] + pieces[2] + pieces[3][:1]  # starts in one token, spans another, ends in a third
    events, _ = run(tokenizer, script, stop=[stop])
    assert text_of(events) == "one two three four"[: "one two three four".find(stop)]
    assert events[-1].finish_reason == "stop"


def test_partial_stop_at_the_end_is_released(tokenizer):
    script = tokenizer.encode("the model wor", add_special=False)
    events, _ = run(tokenizer, script, max_tokens=len(script), stop=["world"])
    assert text_of(events) == "the model wor"
    assert events[-1].finish_reason == "length"
    assert events[-1].text.endswith("wor")  # held back until generation ended


def test_max_tokens(tokenizer):
    script = tokenizer.encode(random_text(50), add_special=False)
    n = int(RNG.integers(1, len(script)))
    events, runtime = run(tokenizer, script, max_tokens=n)
    assert [e.token_id for e in events[:-1]] == script[:n]
    assert events[-1].finish_reason == "length"
    assert events[-1].timings.generated_tokens == n
    assert len(runtime.calls) == n


def test_end_of_generation_token(tokenizer):
    eos = tokenizer.eos_id
    assert eos in tokenizer.eog_ids
    body = tokenizer.encode("the world", add_special=False)
    events, _ = run(tokenizer, body + [eos] + body, max_tokens=50)
    assert [e.token_id for e in events[:-1]] == body
    assert events[-1].finish_reason == "stop" and text_of(events) == "the world"

    events, _ = run(tokenizer, body + [eos] + body, max_tokens=2 * len(body) + 1, ignore_eos=True)
    assert [e.token_id for e in events[:-1]] == body + [eos] + body
    assert text_of(events) == "the worldthe world"  # the control token renders as no text
    assert events[-1].finish_reason == "length"


def test_full_context_ends_generation(tokenizer):
    script = tokenizer.encode(random_text(40), add_special=False)
    events, _ = run(tokenizer, script, prompt=[5] * 10, max_context=16, max_tokens=100)
    assert len(events) - 1 == 6  # 10 prompt + 6 generated fill the 16 positions
    assert events[-1].finish_reason == "length"


def test_timings(tokenizer):
    script = tokenizer.encode("the model of the world", add_special=False)
    events, _ = run(tokenizer, script, prompt=[7] * 9, max_tokens=len(script))
    t = events[-1].timings
    assert (t.prompt_tokens, t.generated_tokens) == (9, len(script))
    assert 0 < t.prefill_s <= t.ttft_s
    assert t.prefill_tok_s == pytest.approx(9 / t.prefill_s)
    assert t.decode_tok_s == pytest.approx((len(script) - 1) / t.decode_s)


def test_argument_errors(tokenizer):
    runtime = ScriptedRuntime([0], tokenizer.vocab_size, max_context=8)
    with pytest.raises(ValueError, match="empty"):
        generate(runtime, tokenizer, [])
    with pytest.raises(ValueError, match="context holds 8"):
        generate(runtime, tokenizer, list(range(8)))
    with pytest.raises(ValueError, match="max_tokens"):
        generate(runtime, tokenizer, [1], max_tokens=0)
    with pytest.raises(ValueError, match="stop strings"):
        generate(runtime, tokenizer, [1], stop=[""])
    assert runtime.calls == []  # nothing ran


def test_stop_matcher_holds_only_possible_prefixes():
    m = StopMatcher(["<end>", "STOP"])
    assert m.push("abc<e") == "abc"
    assert m.push("x") == "<ex"
    assert m.push("ST") == ""
    assert m.push("OP tail") == "" and m.stopped


# ---------------------------------------------------------------------------------------------------------------
# End to end on the default model (real runtime)
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def default_model(default_file):
    import strata_async

    with strata_async.load(default_file) as model:
        yield model


@pytest.mark.slow
def test_default_model_greedy_generation_matches_teacher_forced_logits(default_model):
    prompt = default_model.encode("the model of the world")
    events = list(default_model.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True))
    generated = [e.token_id for e in events[:-1]]
    assert len(generated) == 6 and events[-1].finish_reason == "length"
    logits = default_model.logits(prompt + generated[:-1])
    assert logits.shape == (len(prompt) + 5, default_model.config.vocab_size) and logits.dtype == np.float32
    assert list(np.argmax(logits[len(prompt) - 1:], axis=1)) == generated


@pytest.mark.slow
def test_default_model_seeded_sampling_is_reproducible(default_model):
    def sample(seed):
        return [e.token_id for e in default_model.generate("hello", max_tokens=5, seed=seed, temperature=1.0,
                                                            ignore_eos=True)]
    first = sample(11)
    assert sample(11) == first and len(first) == 6 and first[-1] is None


def test_model_prompt_errors(default_model):
    with pytest.raises(ValueError, match="empty"):
        default_model.generate("")
    with pytest.raises(ValueError, match="empty"):
        default_model.logits([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        default_model.generate([default_model.config.vocab_size])
    long_prompt = [5] * default_model.max_context
    with pytest.raises(ValueError, match="context"):
        default_model.generate(long_prompt)
