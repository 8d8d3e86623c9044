"""xgrammar (vLLM's default backend): JSON schemas, regexes, EBNF grammars and structural tags, compiled to a
token-level automaton with a per-text cache."""
from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from raylm.cluster.core.structured_output.backend_types import (
    CompiledGrammar,
    StructuredOutputBackend,
    StructuredOutputGrammar,
)
from raylm.cluster.core.structured_output.json_schema_support import xgrammar_unsupported
from raylm.common.structured_outputs import StructuredOutputsParams

_ANY_OBJECT = '{"type": "object"}'


def choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are EBNF string literals (same escapes).
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)


def parse_json(text: str | dict[str, Any] | None, field: str) -> Any:
    if isinstance(text, dict):
        return text
    if text is None:  # params.kind is the first field given: "json" has one
        raise ValueError(f"{field}: no JSON schema given")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{field}: not valid JSON ({err})") from None


class XgrammarBackend(StructuredOutputBackend):
    name = "xgrammar"

    def __init__(self, tokenizer: Any = None, vocab_size: int = 0, stop_token_ids: list[int] | None = None,
                 max_threads: int = 2) -> None:
        self.compiler: xgr.GrammarCompiler | None = None
        if tokenizer is not None:
            info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
            self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads)
            self.json_token_mask = _json_token_mask(info.decoded_vocab, vocab_size)

    def check(self, params: StructuredOutputsParams) -> None:
        kind = params.kind
        if params.whitespace_pattern is not None:
            raise ValueError(f"{kind}: the xgrammar backend takes no whitespace_pattern (guidance does)")
        try:
            if kind == "json":
                schema = parse_json(params.json, "json")
                unsupported = xgrammar_unsupported(schema)
                if unsupported:
                    raise ValueError(f"json: the xgrammar backend does not enforce {', '.join(unsupported)}")
                xgr.Grammar.from_json_schema(json.dumps(schema))
            elif kind == "regex":
                xgr.Grammar.from_regex(params.regex or "")
            elif kind == "choice":
                xgr.Grammar.from_ebnf(choice_ebnf(params.choice or []))
            elif kind == "grammar":
                xgr.Grammar.from_ebnf(params.grammar or "")
            elif kind == "structural_tag":
                self._structural_tag_args(params.structural_tag or "")
        except ValueError:
            raise
        except Exception as err:  # xgrammar reports parse errors as RuntimeError
            raise ValueError(f"{kind}: the xgrammar backend cannot compile it: {_first_line(err)}") from None

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        compiler = self.compiler
        assert compiler is not None, "a backend built without a tokenizer only checks"
        kind, any_whitespace = params.kind, not params.disable_any_whitespace
        if kind == "json":
            compiled = compiler.compile_json_schema(json.dumps(parse_json(params.json, "json")),
                                                    any_whitespace=any_whitespace)
        elif kind == "json_object":
            compiled = compiler.compile_json_schema(_ANY_OBJECT, any_whitespace=any_whitespace, strict_mode=False)
        elif kind == "regex":
            compiled = compiler.compile_regex(params.regex or "")
        elif kind == "choice":
            compiled = compiler.compile_grammar(choice_ebnf(params.choice or []))
        elif kind == "grammar":
            compiled = compiler.compile_grammar(params.grammar or "")
        else:
            compiled = compiler.compile_structural_tag(*self._structural_tag_args(params.structural_tag or ""))
        json_mask = self.json_token_mask if kind in ("json", "json_object") else None
        return _XgrammarCompiled(compiled, json_mask)

    @staticmethod
    def _structural_tag_args(text: str) -> tuple[Any, ...]:
        """vLLM's legacy form {"structures": [{"begin", "schema", "end"}], "triggers": [...]}, or xgrammar's own."""
        tag = parse_json(text, "structural_tag")
        if isinstance(tag, dict) and "structures" in tag:
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s.get("schema", {})), end=s["end"])
                     for s in tag["structures"]]
            return items, list(tag.get("triggers", []))
        xgr.Grammar.from_structural_tag(json.dumps(tag))
        return (json.dumps(tag),)


def _json_token_mask(decoded_vocab: list[bytes], vocab_size: int) -> torch.Tensor:
    """Packed int32 [1, W]: the tokens without a raw control character, the only bytes JSON never allows unescaped
    (outside strings only as whitespace, which a control character other than tab, CR or LF is not). xgrammar 0.2's
    length-bounded strings (minLength / maxLength) let them through."""
    allowed = torch.ones(-(-vocab_size // 32) * 32, dtype=torch.bool)
    for token_id, token in enumerate(decoded_vocab[:vocab_size]):
        if any(byte < 0x20 and byte not in b"\t\n\r" for byte in token):
            allowed[token_id] = False
    weights = torch.tensor([1 << bit for bit in range(31)] + [-(1 << 31)], dtype=torch.int64)
    packed = (allowed.view(-1, 32).long() * weights).sum(dim=1)
    return packed.to(torch.int32)[None, :]


class _XgrammarCompiled(CompiledGrammar):
    def __init__(self, compiled: xgr.CompiledGrammar, token_mask: torch.Tensor | None) -> None:
        self.compiled = compiled
        self.token_mask = token_mask

    def new_grammar(self) -> StructuredOutputGrammar:
        return XgrammarGrammar(xgr.GrammarMatcher(self.compiled), self.token_mask)


class XgrammarGrammar(StructuredOutputGrammar):
    def __init__(self, matcher: xgr.GrammarMatcher, token_mask: torch.Tensor | None = None) -> None:
        self.matcher = matcher
        self.token_mask = token_mask  # ANDed into every bitmask row

    def accept_tokens(self, request_id: str, tokens: list[int]) -> bool:
        for i, token in enumerate(tokens):
            if not self.matcher.accept_token(token):
                self.matcher.rollback(i)
                return False
        return True

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        # A token xgrammar refuses leaves the matcher where it was.
        num_valid = 0
        for token in tokens:
            if not self.matcher.accept_token(token):
                break
            num_valid += 1
        self.matcher.rollback(num_valid)
        return tokens[:num_valid]

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)
        if self.token_mask is not None:
            bitmask[index : index + 1] &= self.token_mask

    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()


def _first_line(err: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line.split(": ", 1)[1] if line.startswith("[") and ": " in line else line
