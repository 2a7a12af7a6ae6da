"""Our tokenizer files and runtime tokenizer against transformers' tokenizer (the oracle)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from omnidesk.models.qwen2_5_omni.tokenizer import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    Tokenizer,
    TokenizerError,
    write_tokenizer_files,
)

VOCAB_SIZE = 640
FIRST_SPECIAL = 520

TEXTS = [
    "Hello world!",
    "Set a timer for 10 minutes, please. It's 7:30 and I'll be late.",
    "héllo wörld — naïve café, Straße, 日本語のテキスト, Ελληνικά",
    "emoji 😀👍🏽 and flags 🇫🇷 ok",
    "before<|im_start|>user\nhi<|im_end|>\n<|audio_bos|><|AUDIO|><|AUDIO|><|audio_eos|> after",
    "<|tts_text_bos|><|speaker_0|>x<|speaker_1|><|endoftext|>",
    "  lots   of\n\n spaces\t\tand\r\nnewlines  ",
    "WE'VE THEY'RE you'd 12345 3.14159 $19.99",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(path, vocab_size=VOCAB_SIZE, first_special_id=FIRST_SPECIAL)
    return path


@pytest.fixture(scope="module")
def ours(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def conversation():
    return [
        {"role": "system", "content": [{"type": "text", "text": "You are a calm desk assistant."}]},
        {"role": "user", "content": [{"type": "audio", "audio": "first.wav"},
                                     {"type": "text", "text": "What did I just say?"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "You asked about the weather."}]},
        {"role": "user", "content": [{"type": "audio", "audio": "second.wav"}]},
    ]


def test_hub_layout(tok_dir):
    for name in ["tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "added_tokens.json",
                 "special_tokens_map.json", "chat_template.json"]:
        assert (tok_dir / name).is_file(), name
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "Qwen2Tokenizer"
    assert config["eos_token"] == SPECIAL_TOKENS["im_end"]
    assert config["pad_token"] == SPECIAL_TOKENS["endoftext"]
    assert config["audio_token"] == SPECIAL_TOKENS["audio"]
    decoder = config["added_tokens_decoder"]
    assert [decoder[str(FIRST_SPECIAL + i)]["content"] for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS.values())
    vocab = json.loads((tok_dir / "vocab.json").read_text())
    assert sorted(vocab.values()) == list(range(FIRST_SPECIAL))
    added = json.loads((tok_dir / "added_tokens.json").read_text())
    assert added == {s: FIRST_SPECIAL + i for i, s in enumerate(SPECIAL_TOKENS.values())}


def test_special_ids(tmp_path, ours, hf):
    ids = write_tokenizer_files(tmp_path, vocab_size=VOCAB_SIZE, first_special_id=FIRST_SPECIAL)
    expected = {name: FIRST_SPECIAL + i for i, name in enumerate(SPECIAL_TOKENS)}
    assert ids == expected
    assert ours.special_ids == expected
    for name, s in SPECIAL_TOKENS.items():
        assert ours.token_to_id(s) == expected[name] == hf.convert_tokens_to_ids(s)
        assert ours.id_to_token(expected[name]) == s
    assert ours.vocab_size == FIRST_SPECIAL + len(SPECIAL_TOKENS) == len(hf)
    assert hf.eos_token == SPECIAL_TOKENS["im_end"] and hf.pad_token == SPECIAL_TOKENS["endoftext"]
    assert hf.audio_token == SPECIAL_TOKENS["audio"]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_match_transformers(ours, hf, text):
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False)
    assert all(0 <= i < ours.vocab_size for i in ids)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_atomic(ours):
    for name, s in SPECIAL_TOKENS.items():
        assert ours.encode(s) == [ours.special_ids[name]]
    assert ours.encode("a" + SPECIAL_TOKENS["audio"] * 3 + "b").count(ours.special_ids["audio"]) == 3
    assert ours.decode(ours.encode("hi" + SPECIAL_TOKENS["im_end"])) == "hi"


def test_bpe_merges_are_real(ours):
    # Common corpus words become single tokens; text is not just bytes.
    ids = ours.encode("the assistant")
    assert len(ids) < len(b"the assistant")


def test_render_chat_matches_transformers(tok_dir, ours, hf):
    messages = conversation()
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    template = json.loads((tok_dir / "chat_template.json").read_text())["chat_template"]
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                  chat_template=template) == expected
    got = ours.render_chat(messages, add_generation_prompt=True)
    assert got == expected
    audio = SPECIAL_TOKENS["audio_bos"] + SPECIAL_TOKENS["audio"] + SPECIAL_TOKENS["audio_eos"]
    assert got == (
        "<|im_start|>system\nYou are a calm desk assistant.<|im_end|>\n"
        f"<|im_start|>user\n{audio}What did I just say?<|im_end|>\n"
        "<|im_start|>assistant\nYou asked about the weather.<|im_end|>\n"
        f"<|im_start|>user\n{audio}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # No generation prompt, string content, default system prompt.
    plain = [{"role": "user", "content": "hello"}]
    assert ours.render_chat(plain, add_generation_prompt=False) == hf.apply_chat_template(
        plain, tokenize=False, add_generation_prompt=False)
    assert ours.render_chat(plain).startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_audio_turn_ids(ours, hf):
    messages = conversation()
    counts = [7, 3]
    ids = ours.audio_turn_ids(messages, counts)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    parts = text.split(SPECIAL_TOKENS["audio"])
    expanded = parts[0] + SPECIAL_TOKENS["audio"] * 7 + parts[1] + SPECIAL_TOKENS["audio"] * 3 + parts[2]
    assert ids == hf.encode(expanded, add_special_tokens=False)
    audio_id = ours.special_ids["audio"]
    assert ids.count(audio_id) == sum(counts)
    # Each run of audio ids sits between audio_bos and audio_eos.
    bos, eos = ours.special_ids["audio_bos"], ours.special_ids["audio_eos"]
    starts = [i for i, t in enumerate(ids) if t == bos]
    assert [ids[s + 1: s + 1 + n] for s, n in zip(starts, counts)] == [[audio_id] * n for n in counts]
    assert [ids[s + 1 + n] for s, n in zip(starts, counts)] == [eos, eos]
    with pytest.raises(ValueError, match="2 audio placeholder"):
        ours.audio_turn_ids(messages, [5])


def test_deterministic(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    write_tokenizer_files(a, vocab_size=VOCAB_SIZE, first_special_id=FIRST_SPECIAL)
    write_tokenizer_files(b, vocab_size=VOCAB_SIZE, first_special_id=FIRST_SPECIAL)
    for f in sorted(a.iterdir()):
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name


def test_other_id_layouts(tmp_path):
    # A larger BPE part than the corpus can train (filled up) and a model vocab with unused ids.
    ids = write_tokenizer_files(tmp_path, vocab_size=3000, first_special_id=2048)
    assert ids == {name: 2048 + i for i, name in enumerate(SPECIAL_TOKENS)}
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.vocab_size == 2048 + len(SPECIAL_TOKENS)
    text = "Good morning! The assistant listens."
    assert tok.decode(tok.encode(text)) == text
    with pytest.raises(ValueError):
        write_tokenizer_files(tmp_path / "x", vocab_size=530, first_special_id=520)
    with pytest.raises(ValueError):
        write_tokenizer_files(tmp_path / "y", vocab_size=640, first_special_id=100)


def test_unknown_token_and_id_errors(ours, tok_dir):
    with pytest.raises(TokenizerError, match=r"<\|nope\|>.*tokenizer\.json"):
        ours.token_to_id("<|nope|>")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        ours.id_to_token(VOCAB_SIZE + 5)


def test_missing_tokenizer_json(tok_dir, tmp_path):
    for f in tok_dir.iterdir():
        if f.name != "tokenizer.json":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_files(tok_dir, tmp_path):
    for f in tok_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": ')
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"chat_template\.json"):
        Tokenizer.from_dir(tmp_path)


def test_chat_template_sources(tok_dir, tmp_path):
    for f in tok_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    (tmp_path / "chat_template.json").unlink()
    # Falls back to tokenizer_config.json.
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.chat_template == CHAT_TEMPLATE
    # Neither place: the error names both files.
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(TokenizerError, match=r"chat_template\.json.*tokenizer_config\.json"):
        Tokenizer.from_dir(tmp_path)
