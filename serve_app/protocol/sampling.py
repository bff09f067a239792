"""What completions and chat requests share: the sampling fields, stream options and structured
outputs (`response_format`, vLLM's guided decoding)."""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Literal, Mapping, Optional, Union

from pydantic import (
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from engine.generate.request import Grammar, SamplingParams
from serve_app.protocol.base import OpenAIModel, invalid, unsupported


def _check_stop(value: Union[str, list[str]]) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if any(s == "" for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def _check_logit_bias(bias: dict[str, float]) -> dict[str, float]:
    for key, value in bias.items():
        if not key.lstrip("-").isdigit():
            raise invalid("logit_bias", f"logit_bias keys must be token ids, got {key!r}")
        if not -100.0 <= value <= 100.0:
            raise invalid("logit_bias", f"logit_bias values must be in [-100, 100], got {value} for {key}")
    return bias


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    """Send a last chunk with `usage` (and no choices)."""


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema the output must match."""

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: Optional[str] = None
    schema_: dict[str, Any] = Field({}, alias="schema")
    """A JSON Schema (the draft 2020-12 subset llguidance compiles). Empty: any JSON value."""
    strict: Optional[bool] = None
    """Accepted; the output always matches the schema (constrained decoding)."""


class ResponseFormat(OpenAIModel):
    """`text`: free text. `json_object`: a JSON object. `json_schema`: JSON matching the schema.
    The output is constrained token by token, so it matches whatever the model would rather say;
    a generation cut by max_tokens ends with finish_reason `length` (and is then incomplete)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise invalid("response_format", "response_format.json_schema must be given exactly when type is "
                          "'json_schema'")
        return self

    def grammar(self) -> Optional[Grammar]:
        if self.type == "json_object":
            return Grammar("json_schema", '{"type": "object"}')
        if self.type == "json_schema":
            return Grammar("json_schema", json.dumps(self.json_schema.schema_), "response_format.json_schema.schema")
        return None


class StructuredOutputs(OpenAIModel):
    """vLLM's `structured_outputs` extension: exactly one constraint on the output."""

    json_: Optional[Union[dict[str, Any], str]] = Field(None, alias="json")
    """A JSON schema (an object or its JSON text)."""
    regex: Optional[str] = None
    """A regular expression (Rust regex syntax) the whole output matches."""
    choice: Optional[list[str]] = Field(None, min_length=1)
    """The output is exactly one of these strings."""
    grammar: Optional[str] = None
    """A Lark grammar (llguidance's dialect), starting at `start`."""

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutputs":
        given = [name for name in ("json_", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if len(given) != 1:
            raise invalid("structured_outputs", "structured_outputs takes exactly one of json, regex, choice, grammar")
        return self

    def grammar_spec(self) -> Grammar:
        param = "structured_outputs"
        if self.json_ is not None:
            schema = self.json_ if isinstance(self.json_, str) else json.dumps(self.json_)
            return Grammar("json_schema", schema, param)
        if self.regex is not None:
            return Grammar("regex", self.regex, param)
        if self.choice is not None:
            return Grammar("lark", "start: " + " | ".join(json.dumps(c) for c in self.choice), param)
        return Grammar("lark", self.grammar, param)


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
"""vLLM's older structured-output fields and the structured_outputs key each means."""


class SamplingRequest(OpenAIModel):
    """The base of both request models: this server's extensions beyond OpenAI's fields (vLLM's
    names and meanings), and what both endpoints share."""

    top_k: int = 0
    """Keep the k most likely tokens; 0 or -1 disables."""
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] = []
    """Generation stops after any of these tokens (kept in the token count, not in the text)."""
    ignore_eos: bool = False
    min_tokens: int = 0
    response_format: Optional[ResponseFormat] = None
    """Constrain the output to JSON (an OpenAI field on chat; an extension on completions)."""
    structured_outputs: Optional[StructuredOutputs] = None
    """vLLM's extension: constrain the output to a JSON schema, a regex, a choice or a grammar."""
    guided_json: Optional[Union[dict[str, Any], str]] = None
    """vLLM's older name of structured_outputs.json (still sent by many clients)."""
    guided_regex: Optional[str] = None
    """vLLM's older name of structured_outputs.regex."""
    guided_choice: Optional[list[str]] = None
    """vLLM's older name of structured_outputs.choice."""
    guided_grammar: Optional[str] = None
    """vLLM's older name of structured_outputs.grammar."""
    # vLLM fields accepted at their defaults only (what this server does); another value is a 400.
    skip_special_tokens: bool = True
    """Special tokens are left out of the text (only true is accepted)."""
    spaces_between_special_tokens: bool = True
    """(only true is accepted)"""
    include_stop_str_in_output: bool = False
    """A matched stop string is left out of the text (only false is accepted)."""
    use_beam_search: bool = False
    """(only false is accepted: sampling or greedy decoding)"""
    priority: int = 0
    """(only 0 is accepted: requests are served first come, first served)"""

    _neutral = unsupported({"skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
                             "include_stop_str_in_output": (False,), "use_beam_search": (False,), "priority": (0,)})

    @model_validator(mode="after")
    def _one_constraint(self) -> "SamplingRequest":
        given = [name for name in ("structured_outputs", *GUIDED) if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if len(given) > 1:
            raise invalid(given[1], f"send one constraint on the output, not {' and '.join(given)}")
        if given and given[0] in GUIDED:
            self._guided()  # checked now: a bad one is a 400 naming its field
        return self

    def _guided(self) -> Optional[Grammar]:
        """The grammar of the guided_* field that is set (vLLM's older names), naming that field."""
        name = next((n for n in GUIDED if getattr(self, n) is not None), None)
        if name is None:
            return None
        try:
            spec = StructuredOutputs.model_validate({GUIDED[name]: getattr(self, name)}).grammar_spec()
        except ValidationError as exc:
            raise invalid(name, f"{name}: {exc.errors()[0]['msg']}") from None
        return dataclasses.replace(spec, param=name)

    def grammar(self) -> Optional[Grammar]:
        """The constraint on the output, if the request sets one."""
        if self.structured_outputs is not None:
            return self.structured_outputs.grammar_spec()
        if self.response_format is not None and self.response_format.type != "text":
            return self.response_format.grammar()
        return self._guided()

    _stop = field_validator("stop", check_fields=False)(classmethod(lambda cls, v: _check_stop(v)))
    _logit_bias = field_validator("logit_bias", check_fields=False)(classmethod(lambda cls, v: _check_logit_bias(v)))

    def sampling_params(self, **kwargs) -> SamplingParams:
        """SamplingParams from the fields both endpoints share, plus `kwargs`; raises
        `InvalidRequestError` (a 400) for out-of-range values."""
        return SamplingParams(
            min_tokens=self.min_tokens,
            temperature=self.temperature,
            top_k=0 if self.top_k == -1 else self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias=tuple((int(k), float(v)) for k, v in self.logit_bias.items()),
            seed=self.seed,
            stop_token_ids=tuple(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            grammar=self.grammar(),
            **kwargs,
        )

    def apply_defaults(self, params: SamplingParams, defaults: Mapping[str, float]) -> SamplingParams:
        """`params` with the model's `defaults` (serve_app.sampling_defaults: temperature, top_p,
        top_k, min_p, repetition_penalty) in place of the fields this request did not send; a value
        the request sent, even OpenAI's default, is kept."""
        unset = {name: value for name, value in defaults.items() if name not in self.model_fields_set}
        return dataclasses.replace(params, **unset) if unset else params

    @property
    def stops(self) -> list[str]:
        return list(self.stop)  # validated into a list

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise invalid("stream_options", "stream_options is only allowed when stream is true")


# ---- requests ----
