"""OpenAI-compatible request bodies, validated by pydantic, and the error answers every route documents.

The response bodies are in server.response_models.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import jsonschema
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from server.response_models import ErrorResponse

MAX_N = 16
MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
MAX_TOOLS = 128  # OpenAI's limit
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


def check_stop_sequences(value: str | list[str] | None) -> str | list[str] | None:
    """``value`` itself when it is at most ``MAX_STOP`` non-empty stop sequences (or one, or None)."""
    stops = [value] if isinstance(value, str) else value or []
    if len(stops) > MAX_STOP:
        raise ValueError(f"at most {MAX_STOP} stop sequences are allowed")
    if any(not s for s in stops):
        raise ValueError("stop sequences must not be empty")
    return value


NUL_REFUSED = "must not contain NUL characters (U+0000)"


def refuse_nul(value: str) -> str:
    """``value`` itself when it holds no NUL: ids and names never do, and PostgreSQL refuses it in text."""
    if "\0" in value:
        raise ValueError(NUL_REFUSED)
    return value


NulFreeStr = Annotated[str, AfterValidator(refuse_nul)]
"""An id or name in a request body: a string without NUL, checked by ``refuse_nul``."""


StopSequences = Annotated[str | list[str] | None, AfterValidator(check_stop_sequences)]
"""A request's ``stop`` field: one sequence or a list of them, checked by ``check_stop_sequences``."""


class _Request(BaseModel):
    # Unknown fields are ignored, like OpenAI's API does for forward compatibility.
    model_config = ConfigDict(extra="ignore")


class TextPart(_Request):
    type: Literal["text"]
    text: str


def text_only(value: Any) -> Any:
    """One clear refusal for an image, audio or file part (the models served take text only), instead
    of the union's errors for every way the value fails to be a string or a list of text parts."""
    if isinstance(value, list):
        for part in value:
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(
                    f"this model takes text only: a content part of type {kind!r} cannot be read; "
                    "send a string, or parts of type 'text'"
                )
    return value


Content = Annotated[str | list[TextPart], BeforeValidator(text_only)]


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(_Request):
    role: Literal["system"]
    content: Content
    name: str | None = None


class UserMessage(_Request):
    role: Literal["user"]
    content: Content
    name: str | None = None


class AssistantMessage(_Request):
    role: Literal["assistant"]
    content: Content | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None

    @model_validator(mode="after")
    def _has_content(self) -> AssistantMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        return self


class ToolMessage(_Request):
    role: Literal["tool"]
    content: Content
    tool_call_id: str


Message = Annotated[SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")]


class StreamOptions(_Request):
    include_usage: bool = False


def check_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` itself when it is a valid JSON Schema (by its own ``$schema``, else draft 2020-12)."""
    if not isinstance(schema.get("$schema", ""), str):
        raise ValueError("not a valid JSON Schema: $schema must be a URI string")
    try:
        jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.absolute_path) or "the top level"
        raise ValueError(f"not a valid JSON Schema at {where}: {exc.message}") from None
    return schema


JsonSchema = Annotated[dict[str, Any], AfterValidator(check_json_schema)]
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(_Request):
    name: FunctionName
    description: str | None = None
    parameters: JsonSchema | None = None
    strict: bool | None = None


class FunctionTool(_Request):
    type: Literal["function"]
    function: FunctionDefinition

    @property
    def parameters(self) -> dict[str, Any]:
        """The arguments' schema; a function without one takes an object (OpenAI's default)."""
        return self.function.parameters if self.function.parameters is not None else {"type": "object"}


class ToolChoiceFunction(_Request):
    name: FunctionName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: ToolChoiceFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class JsonSchemaFormat(_Request):
    model_config = ConfigDict(populate_by_name=True)
    name: FunctionName
    description: str | None = None
    schema_: JsonSchema | None = Field(None, alias="schema")
    strict: bool | None = None


class TextFormat(_Request):
    type: Literal["text"]


class JsonObjectFormat(_Request):
    type: Literal["json_object"]


class JsonSchemaResponseFormat(_Request):
    type: Literal["json_schema"]
    json_schema: JsonSchemaFormat


ResponseFormat = Annotated[TextFormat | JsonObjectFormat | JsonSchemaResponseFormat, Field(discriminator="type")]


class ChatCompletionRequest(_Request):
    # The cross-field rule of ``_check_logprobs``, in the schema too (for schema-based clients).
    model_config = ConfigDict(
        json_schema_extra={
            "allOf": [
                {
                    "if": {
                        "properties": {"top_logprobs": {"type": "integer", "minimum": 1}},
                        "required": ["top_logprobs"],
                    },
                    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
                }
            ]
        }
    )

    model: str
    messages: list[Message] = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="SGLang extension; 0 or -1 disables it")
    ignore_eos: bool = Field(False, description="SGLang extension: keep generating past end-of-sequence")
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    stop: StopSequences = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    user: str | None = Field(None, max_length=256)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None, max_length=16)
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ToolChoice | None = Field(
        None, description="Default: 'auto' with tools, 'none' without; 'required' and a named function are enforced."
    )
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = Field(
        None, description="json_object and json_schema are enforced by constrained decoding (docs/tools.md)."
    )
    # OpenAI's deprecated forms of tools, refused with a pointer to their replacements.
    functions: list[dict[str, Any]] | None = Field(None, description="Deprecated by OpenAI: a 400; send tools.")
    function_call: str | dict[str, Any] | None = Field(
        None, description="Deprecated by OpenAI: a 400; send tool_choice."
    )

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value and value not in ("none", "auto"):  # without functions these two change nothing
            replacement = "tools" if info.field_name == "functions" else "tool_choice"
            raise ValueError(f"{info.field_name} is deprecated and not supported: send {replacement} instead")
        return value

    @field_validator("tools")
    @classmethod
    def _unique_tool_names(cls, value: list[FunctionTool] | None) -> list[FunctionTool] | None:
        names = [tool.function.name for tool in value or []]
        if len(set(names)) < len(names):
            raise ValueError("tool function names must be unique")
        return value

    @field_validator("tool_choice")
    @classmethod
    def _choice_among_tools(cls, choice: ToolChoice | None, info: ValidationInfo) -> ToolChoice | None:
        names = [tool.function.name for tool in info.data.get("tools") or []]
        if choice not in (None, "none", "auto") and not names:
            raise ValueError("'required' or a named function is only allowed when tools are given")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"the function {choice.function.name!r} is not among the tools")
        return choice

    @field_validator("response_format")
    @classmethod
    def _json_without_tools(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        if isinstance(value, TextFormat | None) or not info.data.get("tools") or info.data.get("tool_choice") == "none":
            return value
        raise ValueError(
            "json_object and json_schema cannot be combined with tools yet: send tool_choice 'none', "
            "or describe the answer as a tool"
        )

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    @property
    def effective_tool_choice(self) -> Literal["none", "auto", "required"] | NamedToolChoice:
        """What the model may do with tools: OpenAI's defaults filled in ('none' without tools)."""
        if not self.tools:
            return "none"
        return self.tool_choice if self.tool_choice is not None else "auto"

    @property
    def json_format(self) -> JsonObjectFormat | JsonSchemaResponseFormat | None:
        """The response format when it asks for JSON, else None."""
        return None if isinstance(self.response_format, TextFormat | None) else self.response_format

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    @property
    def stop_list(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class FeedbackRequest(_Request):
    # ``_one_of_rating_or_score`` in the schema: exactly one of them is given (and not null). Unlike
    # OpenAI's endpoints this one is tandem's own: an unknown field is a mistake (``index`` for
    # ``choice_index`` would rate choice 0), refused rather than ignored.
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "oneOf": [
                {"required": ["rating"], "properties": {"rating": {"type": "string"}}},
                {"required": ["score"], "properties": {"score": {"type": "number"}}},
            ]
        },
    )

    completion_id: NulFreeStr = Field(min_length=1, max_length=128)
    rating: Literal["up", "down"] | None = None
    score: float | None = Field(None, ge=-1, le=1)
    choice_index: int = Field(0, ge=0, lt=MAX_N)
    comment: str | None = Field(None, max_length=16_384)
    corrected_answer: str | None = Field(None, max_length=262_144)

    @model_validator(mode="after")
    def _one_of_rating_or_score(self) -> FeedbackRequest:
        if (self.rating is None) == (self.score is None):
            raise ValueError("give exactly one of 'rating' ('up' or 'down') or 'score' (in [-1, 1])")
        return self

    @property
    def resolved_score(self) -> float:
        if self.score is not None:
            return self.score
        return 1.0 if self.rating == "up" else -1.0


ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse, "description": text}
    for status, text in {
        400: "Bad request body or parameter",
        401: "Missing or invalid API key",
        404: "Unknown model or completion",
        413: "Request body too large",
        429: "The engine queue is full",
        503: "No engine is ready, or the database is down",
    }.items()
}
ADMIN_ONLY: dict[int | str, dict[str, Any]] = {
    403: {"model": ErrorResponse, "description": "A tenant's API key where the admin key is needed"}
}
"""For every route behind the admin key (given where the routers are included)."""
ERRORS_AS_JSON: dict[int | str, dict[str, Any]] = {
    status: {
        "description": response["description"],
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
    }
    for status, response in {**ERRORS, **ADMIN_ONLY}.items()
}
"""ERRORS for a route whose own answer is not JSON (its response class would name the errors' type)."""
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {
        "model": ErrorResponse,
        "description": "Conflicts with the current state: it exists already, or its status forbids it",
    }
}
"""For routes that can answer 409 as well: ``responses={**ERRORS, **CONFLICT}``."""
