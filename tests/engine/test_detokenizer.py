"""The incremental detokenizer against full decodes of the whole sequence: for fast tokenizers (decoded
by ``tokenizers``' ``DecodeStream``) and for the two-decode fallback (a real slow tokenizer, and the fast
ones seen as slow), on multilingual text (CJK, emoji, combining marks), byte-fallback tokens, special
tokens skipped or kept in the middle, stop strings across token boundaries, and random token ids that
are not valid UTF-8 at all.

The reference is always ``tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)):]`` (taken
where the output's last character is complete): the detokenizer's text must be that, after every token.
"""

from __future__ import annotations

import random
import zlib

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer, ByT5Tokenizer, PreTrainedTokenizerFast

from kvpilot.engine import detokenizer
from kvpilot.engine.detokenizer import IncrementalDetokenizer, StopStrings, stream_backend
from kvpilot.engine.models.synthetic import train_byte_level_bpe, train_sentencepiece_bpe

REPLACEMENT = "\ufffd"
SPECIALS = ["<unk>", "<s>", "</s>", "<|mid|>"]
WORDS = [
    "hello", "world", "stream", "token", "the", "quick", "fox", "\n", "  ", "\t", "1234", "3.14", "(x)",
    "привет", "мир", "данные", "日本語", "東京", "中文字符", "한국어", "안녕하세요", "café", "naïve", "Ωμέγα",
    "مرحبا", "שלום", "∑∫√", "€½", "e\u0301", "a\u0308o\u0308", "n\u0303", "\u0915\u094d\u0937",
    "😀", "👍🏽", "🇩🇪", "👨\u200d👩\u200d👧", "🧑🏿\u200d🚀", "𝔘𝔫𝔦",
]  # fmt: skip


def _text(rng: random.Random, num_words: int) -> str:
    return "".join(rng.choice(WORDS) + rng.choice([" ", "", ", ", ".\n"]) for _ in range(num_words))


def _corpus(seed: int = 0, lines: int = 2000):
    rng = random.Random(seed)
    for _ in range(lines):
        yield _text(rng, rng.randint(3, 12))


def _wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|mid|>"],
        clean_up_tokenization_spaces=False,
    )


def byte_level_bpe(vocab_size: int = 800) -> PreTrainedTokenizerFast:
    """GPT-2 style: byte-level pre-tokenizer and decoder."""
    return _wrap(train_byte_level_bpe(_corpus(), vocab_size, SPECIALS))


def sentencepiece_bpe(vocab_size: int = 600) -> PreTrainedTokenizerFast:
    """Llama-2 style, byte fallback (``<0xE2>`` tokens), a Strip decoder that drops the first space
    (why the detokenizer needs the prompt as left context). A small alphabet: the rarer characters
    (emoji, most CJK) only exist as byte tokens."""
    return _wrap(train_sentencepiece_bpe(_corpus(), vocab_size, SPECIALS, limit_alphabet=70))


class FallbackView:
    """A fast tokenizer seen as a slow one: only ``decode``, so the detokenizer takes its fallback."""

    is_fast = False

    def __init__(self, tok) -> None:
        self.tok = tok
        self.all_special_ids = tok.all_special_ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens)


@pytest.fixture(scope="module")
def fast_tokenizers(tokenizer_dir) -> dict[str, PreTrainedTokenizerFast]:
    return {
        "session": AutoTokenizer.from_pretrained(tokenizer_dir),
        "byte_level": byte_level_bpe(),
        "sentencepiece": sentencepiece_bpe(),
    }


@pytest.fixture(scope="module")
def sp(fast_tokenizers) -> PreTrainedTokenizerFast:
    return fast_tokenizers["sentencepiece"]


# (tokenizer, path): every fast tokenizer on both paths, and ByT5 (a slow tokenizer) on the fallback.
CASES = [
    ("session", "stream"),
    ("byte_level", "stream"),
    ("sentencepiece", "stream"),
    ("byte_level", "fallback"),
    ("sentencepiece", "fallback"),
    ("byt5", "fallback"),
]


@pytest.fixture(scope="module")
def byt5():
    return ByT5Tokenizer()


def _tokenizer(name: str, path: str, fast_tokenizers, byt5):
    tok = byt5 if name == "byt5" else fast_tokenizers[name]
    return FallbackView(tok) if path == "fallback" and name != "byt5" else tok


def _detok(tok, prompt, path: str, skip: bool = True, **kwargs) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tok, prompt, skip, **kwargs)
    # The path is the one the case is about: a fast tokenizer that silently fell back fails here.
    assert detok.uses_decode_stream == (path == "stream")
    return detok


def _ids(tok, rng: random.Random, num_pieces: int, special_rate: float) -> list[int]:
    """Token ids of random multilingual text, with special tokens between some of its pieces."""
    specials = [i for i in tok.all_special_ids if i is not None]
    ids: list[int] = []
    for _ in range(num_pieces):
        if rng.random() < special_rate:
            ids.append(rng.choice(specials))
        else:
            ids += tok.encode(_text(rng, rng.randint(1, 3)), add_special_tokens=False)
    return ids


def _complete_texts(tok, prompt: list[int], output: list[int], skip: bool) -> list[str]:
    """The reference after each output token: the full decode past the prompt's decode, as of the last
    token at which the full decode ended on a complete character."""
    base = tok.decode(prompt, skip_special_tokens=skip)
    texts, current = [], ""
    for j in range(1, len(output) + 1):
        full = tok.decode(prompt + output[:j], skip_special_tokens=skip)
        if not full.endswith(REPLACEMENT):
            assert full.startswith(base)
            current = full[len(base) :]
        texts.append(current)
    return texts


def _split(tok, ids: list[int], rng: random.Random, skip: bool) -> int:
    """A prompt length whose decode ends on a complete character (else a full decode's prompt part is
    not the prompt's own decode)."""
    for _ in range(50):
        k = rng.randint(0, len(ids) - 1)
        if not tok.decode(ids[:k], skip_special_tokens=skip).endswith(REPLACEMENT):
            return k
    return 0


# ---------------------------------------------------------------------------------- which path
def test_fast_tokenizers_are_streamed_and_make_no_decode_calls(fast_tokenizers, byt5, monkeypatch):
    for tok in fast_tokenizers.values():
        assert stream_backend(tok) is tok.backend_tokenizer
        assert IncrementalDetokenizer(tok, [5, 6]).uses_decode_stream
    assert stream_backend(byt5) is None and stream_backend(FallbackView(fast_tokenizers["session"])) is None
    assert not IncrementalDetokenizer(byt5, [5, 6]).uses_decode_stream
    # Per token, the stream path decodes in Rust only; the fallback calls ``decode`` twice.
    for name in ("session", "sentencepiece"):
        tok = fast_tokenizers[name]
        calls = []
        real = tok.decode
        monkeypatch.setattr(
            tok, "decode", lambda ids, calls=calls, real=real, **kw: calls.append(1) or real(ids, **kw)
        )
        ids = tok.encode("hello world 日本語 😀 café", add_special_tokens=False)
        streamed = IncrementalDetokenizer(tok, ids[:2])
        fallback = IncrementalDetokenizer(FallbackView(tok), ids[:2])
        before = len(calls)
        for t in ids[2:]:
            streamed.add_token(t)
        assert len(calls) == before
        for t in ids[2:]:
            fallback.add_token(t)
        assert len(calls) == before + 2 * len(ids[2:])
        assert streamed.text == fallback.text == real(ids)[len(real(ids[:2])) :]
        monkeypatch.undo()


def test_a_decode_that_cleans_up_spaces_takes_the_fallback():
    # A WordPiece tokenizer whose ``decode`` removes the space before punctuation (the backend alone
    # does not): streaming its backend would change the text, so it takes the fallback.
    vocab = {w: i for i, w in enumerate(["[UNK]", "[SEP]", "hello", "world", ".", ",", "!", "a"])}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", clean_up_tokenization_spaces=True)
    ids = fast.encode("hello world . a , hello !", add_special_tokens=False)
    assert fast.decode(ids) != fast.backend_tokenizer.decode(ids)  # the cleanup does change it
    assert stream_backend(fast) is None
    detok = IncrementalDetokenizer(fast, ids[:1])
    for t in ids[1:]:
        detok.add_token(t)
    assert not detok.uses_decode_stream and detok.text == fast.decode(ids)[len(fast.decode(ids[:1])) :]
    fast.clean_up_tokenization_spaces = False
    assert stream_backend(fast) is fast.backend_tokenizer


# ---------------------------------------------------------------------------------- text = full decode
def _check_full_decodes(tok, path: str, skip: bool, rng: random.Random, sequences: int) -> None:
    for _ in range(sequences):
        ids = _ids(tok, rng, rng.randint(2, 12), special_rate=0.15)
        k = _split(tok, ids, rng, skip)
        prompt, output = ids[:k], ids[k:]
        expected = _complete_texts(tok, prompt, output, skip)
        detok = _detok(tok, prompt, path, skip)
        streamed = ""
        for j, t in enumerate(output):
            detok.add_token(t)
            assert detok.text == expected[j], (prompt, output[: j + 1])
            streamed += detok.pop_delta()
        assert streamed + detok.pop_delta(final=True) == expected[-1]


@pytest.mark.parametrize("skip", [True, False], ids=["skip_special", "keep_special"])
@pytest.mark.parametrize("name, path", CASES)
def test_text_is_the_full_decode_after_every_token(name, path, skip, fast_tokenizers, byt5):
    tok = _tokenizer(name, path, fast_tokenizers, byt5)
    _check_full_decodes(tok, path, skip, random.Random(zlib.crc32(f"{name}-{path}-{skip}".encode())), 60)


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
def test_a_stream_without_prefill_is_primed_by_steps(name, fast_tokenizers, monkeypatch):
    # ``DecodeStream(ids=...)`` is newer than ``DecodeStream``: without it the context is stepped through.
    monkeypatch.setattr(detokenizer, "_HAS_PREFILL", False)
    tok = fast_tokenizers[name]
    for skip in (True, False):
        _check_full_decodes(tok, "stream", skip, random.Random(zlib.crc32(name.encode()) + skip), 30)


@pytest.mark.parametrize("name, path", CASES)
def test_special_tokens_in_the_middle(name, path, fast_tokenizers, byt5):
    tok = _tokenizer(name, path, fast_tokenizers, byt5)
    special = tok.all_special_ids[-1]
    words = tok.encode("hello 日本語", add_special_tokens=False)
    more = tok.encode("world 😀", add_special_tokens=False)
    prompt, output = words[:1], words[1:] + [special, special] + more
    for skip in (True, False):
        detok = _detok(tok, prompt, path, skip)
        for t in output:
            detok.add_token(t)
        full = tok.decode(prompt + output, skip_special_tokens=skip)
        assert detok.text == full[len(tok.decode(prompt, skip_special_tokens=skip)) :]
        assert (tok.decode([special]) in detok.text) == (not skip)


# ---------------------------------------------------------------------------------- byte fallback
@pytest.mark.parametrize("path", ["stream", "fallback"])
def test_byte_fallback_character_appears_only_once_complete(sp, path):
    tok = sp if path == "stream" else FallbackView(sp)
    prompt = sp.encode("hello", add_special_tokens=False)
    # Characters the training text never had: spelled as byte tokens.
    for char in ("🦀", "👩🏾\u200d🔬", "龍馬", "ⱥ", "a\u0352"):
        output = sp.encode(" " + char, add_special_tokens=False)
        pieces = sp.convert_ids_to_tokens(output)
        assert sum(p.startswith("<0x") for p in pieces) >= 2, pieces  # really spelled as bytes
        detok = _detok(tok, prompt, path)
        seen = []
        for t in output:
            detok.add_token(t)
            seen.append(detok.text)
        assert detok.text == " " + char  # with the space a full decode shows
        # Text only grows by whole characters: no replacement character, each step's text a prefix.
        assert all((" " + char).startswith(s) for s in seen)
        if len(char) == 1:
            assert seen[-2] == " "  # nothing of the character before its last byte


@pytest.mark.parametrize("path", ["stream", "fallback"])
def test_first_output_token_keeps_its_leading_space(sp, path):
    tok = sp if path == "stream" else FallbackView(sp)
    prompt = sp.encode("hello", add_special_tokens=False)
    output = sp.encode("hello world", add_special_tokens=False)[1:]  # "▁world": a space in a full decode
    assert sp.decode(output) == "world"  # alone the first space is stripped
    detok = _detok(tok, prompt, path)
    for t in output:
        detok.add_token(t)
    assert detok.text == " world"
    # Without a prompt there is nothing before it, as in a full decode.
    detok = _detok(tok, [], path)
    for t in output:
        detok.add_token(t)
    assert detok.text == "world"


@pytest.mark.parametrize("prefill", [True, False], ids=["prefill", "stepped"])
def test_a_refused_token_is_recovered_without_losing_text(sp, prefill, monkeypatch):
    monkeypatch.setattr(detokenizer, "_HAS_PREFILL", prefill)
    # "k" as a byte token, then a lone lead byte, then a word: once the word arrives the decoder sees an
    # invalid byte run and renders "k" as a replacement character too, so the new decode no longer starts
    # with the "k" the stream already emitted, and ``DecodeStream.step`` refuses the word.
    k, lead = sp.convert_tokens_to_ids(["<0x6B>", "<0xE2>"])
    word = sp.encode("hello world", add_special_tokens=False)[1]
    prompt = sp.encode("hello", add_special_tokens=False)
    raw = DecodeStream(ids=prompt, skip_special_tokens=True)
    raw.step(sp.backend_tokenizer, k)
    raw.step(sp.backend_tokenizer, lead)
    with pytest.raises(Exception, match="Invalid prefix"):
        raw.step(sp.backend_tokenizer, word)
    detok = _detok(sp, prompt, "stream")
    for t in (k, lead, word):
        detok.add_token(t)
    # The emitted "k" stays (text is never taken back); the word comes with its space and the lead
    # byte's replacement character, as the full decode ends.
    full = sp.decode(prompt + [k, lead, word])
    assert detok.text == "k" + REPLACEMENT + " world" and full.endswith(REPLACEMENT + " world")
    # And the stream goes on as before.
    more = sp.encode("hello world 日本語", add_special_tokens=False)[1:]
    before = detok.text
    for t in more:
        detok.add_token(t)
    tail = sp.decode(prompt + [k, lead, word] + more)[len(full) :]
    assert detok.text == before + tail and tail.endswith("日本語")


@pytest.mark.parametrize("name", ["byte_level", "sentencepiece"])
@pytest.mark.parametrize("path", ["stream", "fallback"])
def test_random_token_ids(name, path, fast_tokenizers):
    """Random ids (mostly invalid UTF-8 for byte tokens): nothing raises, and the text is the full
    decode's, except where the full decode rewrote text already emitted (a byte run that turns out
    invalid): from the last such rewrite on, the text goes on exactly as the full decode does."""
    base_tok = fast_tokenizers[name]
    tok = base_tok if path == "stream" else FallbackView(base_tok)
    rng = random.Random(7)
    vocab = len(base_tok)
    clean_end = base_tok.encode("hello", add_special_tokens=False)
    rewrites = 0
    for _ in range(300):
        skip = rng.random() < 0.5
        prompt = base_tok.encode(_text(rng, rng.randint(0, 4)), add_special_tokens=False)
        output = [rng.randrange(vocab) for _ in range(rng.randint(1, 16))] + clean_end
        detok = _detok(tok, prompt, path, skip)
        lengths = []
        for t in output:
            detok.add_token(t)
            lengths.append(len(detok.text))
        base = base_tok.decode(prompt, skip_special_tokens=skip)
        settled, last_rewrite = base, -1
        for j in range(len(output)):
            full = base_tok.decode(prompt + output[: j + 1], skip_special_tokens=skip)
            if full.endswith(REPLACEMENT):
                continue
            if not full.startswith(settled):
                last_rewrite = j
            settled = full
            if last_rewrite == -1:
                assert detok.text[: lengths[j]] == full[len(base) :]
        if last_rewrite == -1:
            assert detok.text == settled[len(base) :]
        else:
            rewrites += 1
            at = base_tok.decode(prompt + output[: last_rewrite + 1], skip_special_tokens=skip)
            assert detok.text[lengths[last_rewrite] :] == settled[len(at) :]
    # Byte-level decoding only ever changes its incomplete tail; byte fallback rewrites whole runs (and
    # those cases were exercised).
    assert rewrites == 0 if name == "byte_level" else rewrites >= 10


# ---------------------------------------------------------------------------------- stop strings
@pytest.mark.parametrize("include", [False, True], ids=["cut_before", "cut_after"])
@pytest.mark.parametrize("name, path", CASES)
def test_stop_strings_across_token_boundaries(name, path, include, fast_tokenizers, byt5):
    tok = _tokenizer(name, path, fast_tokenizers, byt5)
    rng = random.Random(11)
    crossing = 0
    for _ in range(40):
        ids = _ids(tok, rng, rng.randint(4, 10), special_rate=0.0)
        k = _split(tok, ids, rng, True)
        prompt, output = ids[:k], ids[k:]
        complete = _complete_texts(tok, prompt, output, True)
        text = complete[-1]
        if len(text) < 4:
            continue
        i = rng.randrange(len(text) - 2)
        stop = text[i : i + rng.randint(2, min(6, len(text) - i))]
        first = text.find(stop)
        expected = text[: first + (len(stop) if include else 0)]
        # Two siblings share one index: each cuts its own text.
        stops = StopStrings([stop, "\x00never"])
        detok = _detok(tok, prompt, path, stop_strings=stops, include_stop_str_in_output=include)
        sibling = _detok(tok, prompt, path, stop_strings=stops, include_stop_str_in_output=include)
        streamed = ""
        for j, t in enumerate(output):
            detok.add_token(t)
            sibling.add_token(t)
            # Streamed text is never taken back: it is always a prefix of the final text.
            streamed += detok.pop_delta()
            assert expected.startswith(streamed)
            if detok.stop_string is None:
                assert detok.text == complete[j]
        assert detok.stop_string == stop and detok.text == expected == sibling.text
        assert streamed + detok.pop_delta(final=True) == expected
        # Some text after a token ended inside the stop string: the match spans a token boundary.
        crossing += any(first < len(c) < first + len(stop) for c in complete)
    assert crossing > 0
