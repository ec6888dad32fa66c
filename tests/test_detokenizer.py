"""Incremental detokenizer, stop strings and reasoning parsers with the real SmolLM2 tokenizer: the
chapter's reference runs, then property tests over random mixed-script text fed one id at a time."""
import functools

import pytest
from hypothesis import given, settings, strategies as st

from nanoserve.frontend.detokenizer import IncrementalDetokenizer
from nanoserve.frontend.reasoning import ReasoningParser, make_reasoning_parser
from nanoserve.sampling_params import SamplingParams


@functools.lru_cache(maxsize=1)
def tokenizer():
    from nanoserve.frontend.tokenizer import load_tokenizer
    from nanoserve.model.loader import default_model_path
    return load_tokenizer(default_model_path())


def stream(ids, params=SamplingParams(), use_decode_stream=None):
    detok = IncrementalDetokenizer(tokenizer(), params, use_decode_stream)
    deltas = []
    for i, token in enumerate(ids):
        detok.update([token])
        deltas.append(detok.get_delta(finished=detok.stopped or i == len(ids) - 1))
        if detok.stopped:
            break
    return deltas, detok


def test_parrot_reference_run():
    ids = tokenizer().encode("鹦鹉🦜说：答案是42。\n解释如下", add_special_tokens=False)
    deltas, detok = stream(ids, SamplingParams(stop=["\n解释"]))
    print("deltas:", deltas)
    assert "".join(deltas) == "鹦鹉🦜说：答案是42。"
    assert detok.stop_reason == "\n解释"
    assert not any("\ufffd" in d or "\n" in d for d in deltas)
    # Byte-level tokens split the CJK characters and the emoji: some steps must emit nothing.
    assert "" in deltas and "🦜" in "".join(deltas)


def test_think_chunks_split_as_in_the_chapter():
    parser = ReasoningParser()
    pieces = [parser.feed(c) for c in ["<thi", "nk>\n用户问 1+1", "，答案是 2。\n</th", "ink>\n\n1+1 等于 ", "2。"]]
    pieces.append(parser.feed("", final=True))
    reasoning = [r for r, _ in pieces if r]
    content = [c for _, c in pieces if c]
    assert reasoning == ["\n用户问 1+1", "，答案是 2。\n"]
    assert content == ["\n\n1+1 等于 ", "2。"]


def test_reasoning_parser_variants():
    def run(parser, chunks):
        out = [parser.feed(c) for c in chunks] + [parser.feed("", final=True)]
        return "".join(r for r, _ in out), "".join(c for _, c in out)

    # qwen3 strips the answer's leading blank lines.
    assert run(make_reasoning_parser("qwen3"), ["<think>a</think>", "\n\n", "\nAnswer"]) == ("a", "Answer")
    # The template opened the think block: the output starts inside the reasoning.
    opened = make_reasoning_parser("qwen3", prompt_text="<|im_start|>assistant\n<think>\n")
    assert run(opened, ["step 1", "</think>\n\nDone"]) == ("step 1", "Done")
    # deepseek_r1: the model never writes the start tag, or repeats it.
    assert run(make_reasoning_parser("deepseek_r1"), ["hmm</thi", "nk>ok"]) == ("hmm", "ok")
    assert run(make_reasoning_parser("deepseek_r1"), ["<think>hmm</think>ok"]) == ("hmm", "ok")
    # Thinking disabled per request: no parser, all content.
    assert make_reasoning_parser("qwen3", chat_template_kwargs={"enable_thinking": False}) is None
    # qwen3 without any think block: all content; a reasoning that never ends stays reasoning.
    assert run(make_reasoning_parser("qwen3"), ["Just ", "an answer"]) == ("", "Just an answer")
    assert run(make_reasoning_parser("deepseek_r1"), ["still thinking <"]) == ("still thinking <", "")
    with pytest.raises(ValueError, match="reasoning parser"):
        make_reasoning_parser("nope")


def test_include_stop_str_min_tokens_and_special_tokens():
    tok = tokenizer()
    ids = tok.encode("one two three two one", add_special_tokens=False)
    deltas, detok = stream(ids, SamplingParams(stop=[" two"], include_stop_str_in_output=True))
    assert "".join(deltas) == "one two"
    # Stop strings count only once min_tokens tokens exist: the first " two" is token 2.
    deltas, _ = stream(ids, SamplingParams(stop=[" two"], min_tokens=3))
    assert "".join(deltas) == "one two three"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    with_special = ids[:2] + [end]
    assert "".join(stream(with_special)[0]) == "one two"
    assert "".join(stream(with_special, SamplingParams(skip_special_tokens=False))[0]) == "one two<|im_end|>"


def test_bad_token_id_is_logged_and_skipped(caplog):
    ids = tokenizer().encode("hello world", add_special_tokens=False)
    for fast in (None, False):
        deltas, _ = stream(ids[:1] + [10**9] + ids[1:], use_decode_stream=fast)
        assert "".join(deltas) == "hello world"
    assert "cannot decode" in caplog.text


PIECES = list("abc xyz,.!?\n\t") + list("你好世界鹦鹉说答案是。，") + ["🦜", "😀", "👍🏽", "é", "e\u0301", "42", "  "]
MIXED = st.lists(st.sampled_from(PIECES), max_size=40).map("".join)


@settings(max_examples=150, deadline=None)
@given(text=MIXED, fast=st.booleans())
def test_deltas_concatenate_to_the_full_decode(text, fast):
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    deltas, _ = stream(ids, use_decode_stream=None if fast else False)
    full = tok.decode(ids, skip_special_tokens=True)
    assert "".join(deltas) == full
    if "\ufffd" not in full:
        assert not any("\ufffd" in d for d in deltas)


def reference_cut(ids, stops, include, min_tokens):
    """From full decodes of every prefix: the first token (past min_tokens) whose text completes a
    stop string, and there the earliest such match (the shorter of two at the same start)."""
    tok = tokenizer()
    def text_of(k):
        # A stream shows a token's text once it ends on a whole character, all of it at once: text
        # visible after k tokens is the decode of the longest prefix that does not end inside a
        # character (a token " " + the first bytes of an emoji shows its space with the emoji).
        for j in range(k, -1, -1):
            text = tok.decode(ids[:j], skip_special_tokens=True)
            if not text.endswith("\ufffd"):
                return text
        return ""
    for k in range(min_tokens + 1, len(ids) + 1):
        prev, text = len(text_of(k - 1)), text_of(k)
        found = [(i, s) for s in stops if (i := text.find(s, max(0, prev - len(s) + 1))) >= 0]
        if found:
            i, s = min(found, key=lambda m: (m[0], len(m[1])))
            return text[:i + len(s) if include else i], s
    return tok.decode(ids, skip_special_tokens=True), None


def test_stop_string_counts_from_when_its_token_shows():
    """A token holding a space and the first bytes of an emoji shows its space only with the emoji's
    last byte, here past min_tokens: the stop string " " then matches there (as in vLLM), found by
    hypothesis."""
    ids = tokenizer().encode("  🦜", add_special_tokens=False)
    deltas, detok = stream(ids, SamplingParams(stop=[" "], min_tokens=2))
    assert "".join(deltas) == reference_cut(ids, [" "], False, 2)[0] == " " and detok.stop_reason == " "


@settings(max_examples=150, deadline=None)
@given(text=MIXED, data=st.data())
def test_stop_strings_cut_like_the_reference(text, data):
    tok = tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    # Stops: pieces of the text itself (so they do occur) and random strings.
    def piece():
        if not text:
            return data.draw(MIXED.filter(bool))
        i = data.draw(st.integers(0, len(text) - 1))
        return text[i:i + data.draw(st.integers(1, 5))]
    stops = [s for s in (piece() for _ in range(data.draw(st.integers(1, 3)))) if s.strip() or s]
    include = data.draw(st.booleans())
    min_tokens = data.draw(st.integers(0, 3))
    params = SamplingParams(stop=stops, include_stop_str_in_output=include, min_tokens=min_tokens)
    deltas, detok = stream(ids, params)
    expected, reason = reference_cut(ids, stops, include, min_tokens)
    sent = ""
    for d in deltas:
        sent += d
        assert expected.startswith(sent)  # nothing past the cut, ever
    assert sent == expected and detok.stop_reason == reason


@settings(max_examples=200, deadline=None)
@given(parts=st.lists(st.sampled_from(["<think>", "</think>", "\n", "\n\n", "a", "思考", " b ", "<", "</"]),
                      max_size=12),
       cuts=st.lists(st.integers(0, 80), max_size=6), name=st.sampled_from([None, "qwen3", "deepseek_r1"]))
def test_any_chunking_gives_the_same_split(parts, cuts, name):
    text = "".join(parts)
    make = (lambda: ReasoningParser()) if name is None else (lambda: make_reasoning_parser(name))

    def run(chunks):
        parser = make()
        out = [parser.feed(c) for c in chunks] + [parser.feed("", final=True)]
        return "".join(r for r, _ in out), "".join(c for _, c in out)

    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0] + bounds, bounds + [len(text)])]
    assert run(chunks) == run([text]) == run(list(text))


def test_two_stop_strings_at_the_same_start_the_shorter_wins():
    ids = tokenizer().encode("aa", add_special_tokens=False)  # found by hypothesis: "aa" is one token
    for include, text in [(True, "a"), (False, "")]:
        deltas, detok = stream(ids, SamplingParams(stop=["aa", "a"], include_stop_str_in_output=include))
        assert "".join(deltas) == text and detok.stop_reason == "a"


def test_api_server_side_never_imports_torch(smollm_tokenizer, smollm_path):
    """An API-server process loads the app and the model's (cached, converted) tokenizer without
    importing torch: ~300 MB less per process."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import nanoserve.entrypoints.openai.api_server\n"
            "from nanoserve.frontend.tokenizer import load_tokenizer\n"
            "tok = load_tokenizer(sys.argv[1])\n"
            "assert tok.encode('Hello world')\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    subprocess.run([sys.executable, "-c", code, smollm_path], check=True, timeout=120)
