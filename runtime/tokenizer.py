"""Tokenizers rebuilt from the bytes embedded in a .tinf file, plus streaming detokenization.

Two kinds: "hf-json" (a Hugging Face tokenizer.json, run by the `tokenizers` library) and
"sentencepiece" (a tokenizer.model, run by `sentencepiece`; llama2.c and older checkpoints).
Both map special-token strings typed in the text to their ids (as transformers does), ignore
tokenizer.json's post-processor, and prepend BOS when the file's `add_bos` says so, so the two
kinds encode the Llama 2 tokenizer identically.
"""

from __future__ import annotations

import re

from tinyinfer.formats import FormatError
from tinyinfer.formats.errors import shown

REPLACEMENT_CHAR = "\ufffd"
# What a Rust panic inside `tokenizers` or a C++ error in `sentencepiece` becomes in Python: pyo3's
# PanicException derives from BaseException, so `except Exception` alone would let it escape.
EXITS = (KeyboardInterrupt, SystemExit, GeneratorExit)


def library_failure(e: BaseException, what: str) -> FormatError:
    """A project error for an exception out of a tokenizer library (re-raising the ways out)."""
    if isinstance(e, EXITS):
        raise e
    return FormatError(f"The model's tokenizer failed {what} ({type(e).__name__}: {shown(str(e), 120)}); "
                       "re-convert the checkpoint with a working tokenizer.")


class Tokenizer:
    """Common interface: encode, decode, stream. Subclasses implement _encode, _decode, vocab_size."""

    kind: str
    vocab_size: int

    def __init__(self, bos_id, eos_ids, add_bos, special_tokens):
        self.bos_id = bos_id
        self.eos_ids = frozenset(int(i) for i in eos_ids)
        self.add_bos = bool(add_bos) and bos_id is not None
        self.special_tokens = dict(special_tokens or {})

    @staticmethod
    def from_metadata(meta: dict) -> "Tokenizer":
        """Build the tokenizer described by the `tokenizer` map of a .tinf file."""
        kind = meta.get("kind")
        common = dict(bos_id=meta.get("bos_id"), eos_ids=meta.get("eos_ids") or [],
                      add_bos=meta.get("add_bos", False), special_tokens=meta.get("special_tokens"))
        if kind == "hf-json" and isinstance(meta.get("tokenizer_json"), str) and meta["tokenizer_json"]:
            return HFTokenizer(meta["tokenizer_json"], **common)
        if kind == "sentencepiece" and isinstance(meta.get("tokenizer_model"), bytes) and meta["tokenizer_model"]:
            return SentencePieceTokenizer(bytes(meta["tokenizer_model"]), **common)
        raise FormatError(f"The model's tokenizer (kind {shown(kind)}) is missing or unsupported; "
                          "re-convert the checkpoint with a tokenizer.json or tokenizer.model.")

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Text -> ids; BOS is prepended when add_bos (default: the model's setting) is true."""
        try:
            ids = self._encode(text)
        except BaseException as e:
            raise library_failure(e, "to encode text") from None
        if self.add_bos if add_bos is None else (add_bos and self.bos_id is not None):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids) -> str:
        """Ids -> text, skipping special tokens and ids the tokenizer does not know (padded vocab)."""
        known = [int(i) for i in ids if 0 <= int(i) < self.vocab_size]
        try:
            return self._decode(known)
        except BaseException as e:
            raise library_failure(e, "to decode ids") from None

    def stream(self, prefix_ids=()) -> "StreamDecoder":
        """A streaming detokenizer; prefix_ids (e.g. the prompt) give the context for leading spaces."""
        return StreamDecoder(self, prefix_ids)


class HFTokenizer(Tokenizer):
    kind = "hf-json"

    def __init__(self, tokenizer_json: str, **common):
        import tokenizers

        super().__init__(**common)
        try:
            self.backend = tokenizers.Tokenizer.from_str(tokenizer_json)
            # transformers ignores tokenizer.json's truncation and padding unless asked: they would cut
            # every prompt silently, and absurd values make the library panic.
            self.backend.no_truncation()
            self.backend.no_padding()
            self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)
            self.max_id = max(self.backend.get_vocab(with_added_tokens=True).values(), default=-1)
        except BaseException as e:
            if isinstance(e, EXITS):
                raise
            raise FormatError(f"The embedded tokenizer.json cannot be parsed ({shown(str(e), 120)}); "
                              "re-convert the checkpoint.") from None

    def _encode(self, text):
        return self.backend.encode(text, add_special_tokens=False).ids

    def _decode(self, ids):
        return self.backend.decode(ids, skip_special_tokens=True)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, model_proto: bytes, **common):
        import sentencepiece

        super().__init__(**common)
        self.backend = sentencepiece.SentencePieceProcessor()
        try:
            self.backend.LoadFromSerializedProto(model_proto)
        except BaseException as e:
            if isinstance(e, EXITS):
                raise
            raise FormatError(f"The embedded tokenizer.model cannot be parsed ({shown(str(e), 120)}); "
                              "re-convert the checkpoint.") from None
        self.vocab_size = self.backend.get_piece_size()
        self.max_id = self.vocab_size - 1
        # Control pieces typed in text (e.g. "<s>" written by a chat template) become their ids, as
        # tokenizer.json's added tokens do; SentencePiece alone would spell them out as characters.
        sp = self.backend
        controls = {sp.id_to_piece(i): i for i in range(self.vocab_size) if sp.is_control(i) or sp.is_unknown(i)}
        self.control_ids = controls
        self.control_pattern = re.compile("(" + "|".join(
            re.escape(p) for p in sorted(controls, key=len, reverse=True)) + ")") if controls else None

    def _encode(self, text):
        if self.control_pattern is None:
            return self.backend.encode(text)
        ids = []
        for i, piece in enumerate(self.control_pattern.split(text)):
            if i % 2:
                ids.append(self.control_ids[piece])
            elif piece:
                ids.extend(self.backend.encode(piece))
        return ids

    def _decode(self, ids):
        return self.backend.decode(ids)


class StreamDecoder:
    """Turns ids arriving one at a time into text chunks whose concatenation equals decode(all ids).

    The same algorithm as tokenizers' DecodeStream: decode a short window of ids twice, with and
    without the new ones, and emit only the difference. Decoding in context keeps the leading
    space a lone token would lose, and a window that ends in U+FFFD (a UTF-8 character split across
    byte-fallback tokens) is held back until the character is complete.
    """

    def __init__(self, tokenizer: Tokenizer, prefix_ids=()):
        self.tokenizer = tokenizer
        self.ids = [int(i) for i in prefix_ids]
        self.prefix_offset = max(len(self.ids) - 6, 0)   # a few ids of context are enough
        self.read_offset = len(self.ids)

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes ("" while a character is still incomplete)."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Text held back at the end (e.g. an incomplete UTF-8 sequence, emitted as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        decode = self.tokenizer.decode
        before = decode(self.ids[self.prefix_offset:self.read_offset])
        after = decode(self.ids[self.prefix_offset:])
        if not after.startswith(before):
            # A decoder that is not prefix-stable over this window: fall back to the full text.
            before = decode(self.ids[:self.read_offset])
            after = decode(self.ids)
        if len(after) <= len(before) or (after.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return after[len(before):]
