"""Qwen2.5-Omni text tokenizer: byte-level BPE from ``tokenizer.json`` plus the chat template.

The runtime side (:class:`Tokenizer`) reads a checkpoint's hub files with the
``tokenizers`` library and renders the chat template with a sandboxed jinja2
environment, the way transformers does, without importing transformers.

The writer side (:func:`write_tokenizer_files`) builds a small but real Qwen2-style
tokenizer (a BPE trained on a built-in English text) for test and demo checkpoints.

No token id is written here: ids come from the tokenizer files (and config.json).
Only the token *strings* are fixed.  The first ten are the real Qwen2.5-Omni
added tokens.  The real tokenizer has no strings for the talker's TTS text ids
(``tts_text_*_token_id`` in config.json) or for the speaker bos ids (``bos_token``
in spk_dict.pt): those ids lie past the tokenizer's last added token and are only
rows of the thinker's larger embedding table.  The strings below for them exist
only in tokenizers written by :func:`write_tokenizer_files`;
:attr:`Tokenizer.special_ids` leaves out whatever a tokenizer does not have, so
runtime code must take those ids from config.json / spk_dict.pt.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

from ..checkpoint import CheckpointError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.json"
CHAT_TEMPLATE_JINJA_FILE = "chat_template.jinja"

SPECIAL_TOKENS: "OrderedDict[str, str]" = OrderedDict(
    [
        ("endoftext", "<|endoftext|>"),
        ("im_start", "<|im_start|>"),
        ("im_end", "<|im_end|>"),
        ("audio_bos", "<|audio_bos|>"),
        ("audio_eos", "<|audio_eos|>"),
        ("audio", "<|AUDIO|>"),
        ("image_pad", "<|IMAGE|>"),
        ("video_pad", "<|VIDEO|>"),
        ("vision_bos", "<|vision_bos|>"),
        ("vision_eos", "<|vision_eos|>"),
        # Not in the real tokenizer (see module docstring): names of our own.
        ("tts_text_bos", "<|tts_text_bos|>"),
        ("tts_text_eod", "<|tts_text_eod|>"),
        ("tts_text_pad", "<|tts_text_pad|>"),
        ("speaker_0", "<|speaker_0|>"),
        ("speaker_1", "<|speaker_1|>"),
    ]
)

# Qwen2's pre-tokenizer split (contractions, letters, single digits, punctuation, newlines, spaces).
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
MODEL_MAX_LENGTH = 32768


class TokenizerError(CheckpointError):
    """A tokenizer file is missing, unreadable or inconsistent; the message names the file."""


# --------------------------------------------------------------------------------------
# Chat template
# --------------------------------------------------------------------------------------


def chat_template(t: "Mapping[str, str]" = SPECIAL_TOKENS, audio_names=("audio_bos", "audio", "audio_eos"),
                  image_names=("vision_bos", "image_pad", "vision_eos"),
                  video_names=("vision_bos", "video_pad", "vision_eos")) -> str:
    """Our Jinja chat template; renders the same text as the Qwen2.5-Omni one.

    Each turn is ``<|im_start|>{role}\\n{content}<|im_end|>\\n``; a conversation that does
    not open with a system turn gets the default system prompt; media parts render as
    ``<|audio_bos|><|AUDIO|><|audio_eos|>`` / ``<|vision_bos|><|IMAGE|><|vision_eos|>`` /
    ``<|vision_bos|><|VIDEO|><|vision_eos|>`` (optionally numbered with add_audio_id /
    add_vision_id); the generation prompt is ``<|im_start|>assistant\\n``.
    """
    audio = "".join(t[n] for n in audio_names)
    image = "".join(t[n] for n in image_names)
    video = "".join(t[n] for n in video_names)
    start, end = t["im_start"], t["im_end"]
    lines = [
        "{%- set counts = namespace(audio=0, image=0, video=0) -%}",
        "{%- for message in messages -%}",
        "    {%- if loop.first and message['role'] != 'system' -%}",
        f"        {{{{- '{start}system\\n{DEFAULT_SYSTEM_PROMPT}{end}\\n' -}}}}",
        "    {%- endif -%}",
        f"    {{{{- '{start}' + message['role'] + '\\n' -}}}}",
        "    {%- if message['content'] is string -%}",
        "        {{- message['content'] -}}",
        "    {%- else -%}",
        "        {%- for part in message['content'] -%}",
        "            {%- if part['type'] == 'image' or 'image' in part or 'image_url' in part -%}",
        "                {%- set counts.image = counts.image + 1 -%}",
        "                {%- if add_vision_id -%}{{- 'Picture ' ~ counts.image ~ ': ' -}}{%- endif -%}",
        f"                {{{{- '{image}' -}}}}",
        "            {%- elif part['type'] == 'audio' or 'audio' in part or 'audio_url' in part -%}",
        "                {%- set counts.audio = counts.audio + 1 -%}",
        "                {%- if add_audio_id -%}{{- 'Audio ' ~ counts.audio ~ ': ' -}}{%- endif -%}",
        f"                {{{{- '{audio}' -}}}}",
        "            {%- elif part['type'] == 'video' or 'video' in part -%}",
        "                {%- set counts.video = counts.video + 1 -%}",
        "                {%- if add_vision_id -%}{{- 'Video ' ~ counts.video ~ ': ' -}}{%- endif -%}",
        f"                {{{{- '{video}' -}}}}",
        "            {%- elif 'text' in part -%}",
        "                {{- part['text'] -}}",
        "            {%- endif -%}",
        "        {%- endfor -%}",
        "    {%- endif -%}",
        f"    {{{{- '{end}\\n' -}}}}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}",
        f"    {{{{- '{start}assistant\\n' -}}}}",
        "{%- endif -%}",
    ]
    return "\n".join(lines) + "\n"


CHAT_TEMPLATE = chat_template()


def _compile_template(source: str, where: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise TokenizerError(f"{where}: chat template does not parse: {e}") from e


# --------------------------------------------------------------------------------------
# Runtime tokenizer
# --------------------------------------------------------------------------------------


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TokenizerError(f"missing tokenizer file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"cannot read tokenizer file {path}: {e}") from e
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"corrupt tokenizer file {path}: not valid JSON ({e})") from e


def _template_from_config(value: Any, where: Path) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}, ...]
        named = {d.get("name"): d.get("template") for d in value if isinstance(d, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise TokenizerError(f"{where}: 'chat_template' is neither a string nor a list with a 'default' entry")


class Tokenizer:
    """A checkpoint's text tokenizer and chat template (see :meth:`from_dir`)."""

    def __init__(self, backend, chat_template: str, *, path: Path | None = None,
                 config: Mapping[str, Any] | None = None, template_source: str = "chat template"):
        self._tok = backend
        self.path = Path(path) if path is not None else None
        self.config = dict(config or {})
        self.chat_template = chat_template
        self._template = _compile_template(chat_template, template_source)
        self._file = str(self.path / TOKENIZER_FILE) if self.path is not None else TOKENIZER_FILE
        self.special_ids = {name: i for name, s in SPECIAL_TOKENS.items()
                            if (i := self._tok.token_to_id(s)) is not None}

    @classmethod
    def from_dir(cls, path) -> "Tokenizer":
        """Load ``tokenizer.json`` and the chat template (chat_template.json, chat_template.jinja
        or tokenizer_config.json, first found) from a checkpoint directory."""
        from tokenizers import Tokenizer as Backend

        path = Path(path)
        tok_file = path / TOKENIZER_FILE
        if not tok_file.is_file():
            raise TokenizerError(f"missing tokenizer file: {tok_file}")
        try:
            backend = Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise TokenizerError(f"corrupt tokenizer file {tok_file}: {e}") from e

        config_file = path / TOKENIZER_CONFIG_FILE
        config = _read_json(config_file) if config_file.is_file() else {}
        if not isinstance(config, dict):
            raise TokenizerError(f"corrupt tokenizer file {config_file}: expected a JSON object")

        template, source = None, None
        json_file, jinja_file = path / CHAT_TEMPLATE_FILE, path / CHAT_TEMPLATE_JINJA_FILE
        if json_file.is_file():
            data = _read_json(json_file)
            if not isinstance(data, dict) or not isinstance(data.get("chat_template"), str):
                raise TokenizerError(f"corrupt tokenizer file {json_file}: expected a string 'chat_template'")
            template, source = data["chat_template"], str(json_file)
        elif jinja_file.is_file():
            try:
                template, source = jinja_file.read_text(encoding="utf-8"), str(jinja_file)
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"cannot read tokenizer file {jinja_file}: {e}") from e
        else:
            template = _template_from_config(config.get("chat_template"), config_file)
            source = str(config_file)
        if template is None:
            raise TokenizerError(
                f"no chat template in {path}: missing {CHAT_TEMPLATE_FILE} (or {CHAT_TEMPLATE_JINJA_FILE}) "
                f"and no 'chat_template' in {TOKENIZER_CONFIG_FILE}")
        return cls(backend, template, path=path, config=config, template_source=source)

    # -- ids <-> text ----------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows (BPE vocab plus added tokens)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token strings in it map to their single ids, no BOS."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int:
        i = self._tok.token_to_id(token)
        if i is None:
            raise TokenizerError(f"token {token!r} is not in the vocabulary of {self._file}")
        return i

    def id_to_token(self, token_id: int) -> str:
        s = self._tok.id_to_token(int(token_id))
        if s is None:
            raise TokenizerError(f"token id {token_id} is not in the vocabulary of {self._file}")
        return s

    # -- chat ------------------------------------------------------------------------------

    def render_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    **kwargs) -> str:
        """The chat template applied to ``messages`` (text, as transformers' ``apply_chat_template``
        with ``tokenize=False``)."""
        context = {k: v for k, v in self.config.items()
                   if k.endswith("_token") and isinstance(v, str)}  # eos_token, audio_token, ...
        context.update(kwargs)
        return self._template.render(messages=list(messages), add_generation_prompt=add_generation_prompt,
                                     **context)

    def audio_turn_ids(self, messages: Sequence[Mapping[str, Any]], num_audio_tokens: Sequence[int],
                       add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat with the i-th audio placeholder repeated
        ``num_audio_tokens[i]`` times (what the processor does to the text before tokenizing)."""
        placeholder = SPECIAL_TOKENS["audio"]
        pieces = self.render_chat(messages, add_generation_prompt=add_generation_prompt).split(placeholder)
        counts = [int(n) for n in num_audio_tokens]
        if len(pieces) - 1 != len(counts):
            raise ValueError(f"the rendered chat has {len(pieces) - 1} audio placeholder(s) {placeholder} "
                             f"but {len(counts)} audio token count(s) were given")
        if any(n < 0 for n in counts):
            raise ValueError(f"audio token counts must be >= 0, got {counts}")
        text = pieces[0] + "".join(placeholder * n + piece for n, piece in zip(counts, pieces[1:]))
        return self.encode(text)


# --------------------------------------------------------------------------------------
# Writer: a small real tokenizer in the hub layout
# --------------------------------------------------------------------------------------

_CORPUS = """\
Good morning! I am the desk assistant that lives on this computer. I listen when you talk to me,
I think about what you said, and then I answer out loud. Nothing you say leaves this machine.

You can ask me to set a timer for ten minutes, to read the last message again, or to explain
what a word means. If I don't understand, I'll say so and ask you to repeat the question.
When the room is noisy, please speak a little closer to the microphone.

Here is how a typical morning goes. First you say hello. Then you ask about the weather,
the calendar and the news. I can't look at the internet, so I tell you what I know and what
I'm not sure about. Later you might want to write an email, plan a trip or practise a speech;
we can work through it together, one step at a time.

The assistant understands speech because an audio encoder turns sound into features. The
language model reads those features together with the text of the conversation, and a second
model turns the answer back into a voice. Every part runs on the local processor or the graphics
card, with no network connection at all.

Numbers matter too: 1, 2, 3, 10, 42, 100, 2024, 3.14 and 0.5 seconds. Dates such as
12 March or 2025-06-01 and times like 7:30 or 18:45 should be read correctly. Prices: $19.99,
EUR 5, 250 grams, 3 kilometres, 72 degrees.

Questions people often ask: What time is it? How long will it take? Where did I put my keys?
Could you speak more slowly? Would you repeat that, please? What's the difference between
"affect" and "effect"? Why is the sky blue? How do I cook rice without burning it?

Short answers are best when you are busy; longer answers are better when you want to learn.
She said, "Let's try again tomorrow." They're sure it'll work, and we've already checked it.
The quick brown fox jumps over the lazy dog while the five boxing wizards jump quickly.

def greet(name):
    return "Hello, " + name + "!"

for i in range(3):
    print(i, greet("world"))

A few reminders for today: water the plants in the kitchen, call the dentist before noon,
and send the report to the team by five o'clock. The meeting with the design group moved to
Thursday afternoon, in the small room next to the library.

When you read a recipe aloud, I will wait for you between the steps. Mix the flour with the
water, add a little salt, and let the dough rest for twenty minutes. While it rests, cut the
vegetables, heat the pan and prepare the sauce. Taste it, then decide whether it needs more.

Learning a language takes patience. Listen to short stories, repeat the sentences you hear,
and practise speaking every day. Mistakes are normal; they show you what to work on next.
I can read a sentence slowly, spell a difficult word, or translate a simple phrase for you.

If the answer sounds wrong, tell me, and I will try to explain my reasoning more clearly.
Sometimes the best answer is a question: what exactly do you want to know, and why?

Thank you for listening. Have a good day, and talk to me again whenever you like.
"""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _train_bpe(n_tokens: int, extra_corpus: str = "") -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE with exactly ``n_tokens`` entries: trained on the built-in corpus, then
    (if the corpus runs out of pairs) extended with merges of already known tokens."""
    from tokenizers import Regex, Tokenizer as Backend, normalizers, pre_tokenizers
    from tokenizers.models import BPE
    from tokenizers.trainers import BpeTrainer

    tok = Backend(BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(Regex, pre_tokenizers)
    trainer = BpeTrainer(vocab_size=n_tokens, min_frequency=2, show_progress=False, special_tokens=[],
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator((_CORPUS + extra_corpus).splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = dict(sorted(model["vocab"].items(), key=lambda kv: kv[1]))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    if sorted(vocab.values()) != list(range(len(vocab))):
        raise TokenizerError("trained BPE vocabulary ids are not contiguous")
    if len(vocab) > n_tokens:
        raise TokenizerError(f"trained BPE has {len(vocab)} tokens, more than the {n_tokens} requested")

    # Fill up: merge pairs of the first-ranked tokens (in id order) into new tokens.
    byte_chars = [c for c in _bytes_to_unicode().values()]
    base = [c for c in sorted(byte_chars) if c.isalnum()] or sorted(byte_chars)
    known = list(vocab)
    i = 0
    while len(vocab) < n_tokens:
        left = known[i % len(known)]
        for c in base:
            if len(vocab) >= n_tokens:
                break
            new = left + c
            if new not in vocab:
                vocab[new] = len(vocab)
                merges.append((left, c))
                known.append(new)
        i += 1
    return vocab, merges


def _pre_tokenizer(Regex, pre_tokenizers):
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])


def _added_token_entry(content: str) -> dict[str, Any]:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def write_tokenizer_files(path, vocab_size: int, first_special_id: int,
                          specials: "Mapping[str, str]" = SPECIAL_TOKENS, media: "Mapping[str, str] | None" = None,
                          template: str = CHAT_TEMPLATE, processor_class: str = "Qwen2_5OmniProcessor",
                          extra_corpus: str = "") -> dict[str, int]:
    """Write a small byte-level BPE tokenizer in the hub layout to ``path``.

    The BPE vocabulary fills ids ``0 .. first_special_id-1``; the special tokens follow at
    ``first_special_id + i`` in ``specials`` order (default :data:`SPECIAL_TOKENS`; another
    family passes its own strings, ``media`` (tokenizer_config key -> special name) and chat
    ``template``; ``extra_corpus`` is trained on besides the built-in text, e.g. role names that
    must be single tokens as in the real vocabulary).  Ids from there up to
    ``vocab_size`` stay unused (the model's embedding table may be larger than the tokenizer,
    as in the real model).  Deterministic: the same arguments give byte-identical files.
    Returns ``{name: id}`` for the special tokens.
    """
    from tokenizers import AddedToken, Regex, Tokenizer as Backend, decoders, normalizers, pre_tokenizers, processors
    from tokenizers.models import BPE

    vocab_size, first_special_id = int(vocab_size), int(first_special_id)
    n_alphabet = 256
    if first_special_id < n_alphabet:
        raise ValueError(f"first_special_id {first_special_id} leaves no room for the {n_alphabet} byte tokens")
    if first_special_id + len(specials) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for {len(specials)} special tokens "
                         f"starting at {first_special_id}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)

    vocab, merges = _train_bpe(first_special_id, extra_corpus)
    tok = Backend(BPE(vocab=vocab, merges=merges, dropout=None, unk_token=None, continuing_subword_prefix="",
                      end_of_word_suffix="", fuse_unk=False, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = _pre_tokenizer(Regex, pre_tokenizers)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False, lstrip=False, rstrip=False,
                                       single_word=False) for s in specials.values()])
    ids = {name: tok.token_to_id(s) for name, s in specials.items()}
    expected = {name: first_special_id + i for i, name in enumerate(specials)}
    if ids != expected:
        raise TokenizerError(f"special token ids came out as {ids}, expected {expected}")

    t = specials
    eos, pad = t["im_end"], t["endoftext"]
    extra = [s for s in t.values() if s not in (eos, pad)]
    if media is None:
        media = {"audio_token": "audio", "audio_bos_token": "audio_bos", "audio_eos_token": "audio_eos",
                 "image_token": "image_pad", "video_token": "video_pad",
                 "vision_bos_token": "vision_bos", "vision_eos_token": "vision_eos"}
    media = {key: t[name] for key, name in media.items()}
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(ids[name]): _added_token_entry(s) for name, s in t.items()},
        "additional_special_tokens": extra,
        **media,
        "bos_token": None,
        "chat_template": template,
        "clean_up_tokenization_spaces": False,
        "eos_token": eos,
        "errors": "replace",
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": pad,
        "processor_class": processor_class,
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    special_tokens_map = {
        "additional_special_tokens": extra,
        **media,
        "eos_token": {"content": eos, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
        "pad_token": {"content": pad, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False},
    }

    def dump(obj) -> str:
        return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"

    files = {
        TOKENIZER_FILE: tok.to_str(pretty=True) + "\n",
        TOKENIZER_CONFIG_FILE: dump(tokenizer_config),
        "vocab.json": json.dumps(vocab, ensure_ascii=False) + "\n",
        "merges.txt": "#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
        "added_tokens.json": dump(dict(sorted({s: ids[n] for n, s in t.items()}.items()))),
        "special_tokens_map.json": dump(special_tokens_map),
        CHAT_TEMPLATE_FILE: dump({"chat_template": template}),
    }
    for name, text in files.items():
        (path / name).write_text(text, encoding="utf-8")
    return ids


__all__ = ["SPECIAL_TOKENS", "CHAT_TEMPLATE", "chat_template", "PRETOKENIZE_REGEX", "Tokenizer", "TokenizerError",
           "write_tokenizer_files"]
