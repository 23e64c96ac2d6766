"""The OpenAI request and response bodies hardy serves, as pydantic models: FastAPI validates every
request against them and publishes them in /openapi.json. Unknown request fields are ignored, as
OpenAI does; known ones are checked strictly (a string is not a number, a number not a boolean)."""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictStr

NonEmpty = Annotated[StrictStr, Field(min_length=1)]


def _whole_number(value):
    """JSON Schema counts 3.0 as an integer; so do we. Booleans and strings are not numbers here."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError("must be an integer")
    return value


def integer(**bounds):
    # the bounds first: after the validator they would reach the JSON schema as "ge" instead of "minimum"
    return Annotated[int, Field(**bounds), BeforeValidator(_whole_number)]


Count = integer(ge=1)
OnlyOne = integer(ge=1, le=1, description="only 1 is supported")
Seed = integer()


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    max_tokens: Optional[Count] = None
    n: Optional[OnlyOne] = None
    # strict floats take integers too, but neither strings nor booleans
    temperature: Optional[Annotated[float, Field(strict=True, ge=0, le=2)]] = None
    top_p: Optional[Annotated[float, Field(strict=True, gt=0, le=1)]] = None
    seed: Optional[Seed] = None
    stream: Optional[StrictBool] = False
    stop: Optional[Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=4)]]] = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Request):
    prompt: Union[NonEmpty, Annotated[list[NonEmpty], Field(min_length=1, max_length=1)]]

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr


class ChatCompletionRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    # newer OpenAI clients send this name for the same limit (it wins when both are given)
    max_completion_tokens: Optional[Count] = None


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Optional[Literal["stop", "length"]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: FinishReason
    logprobs: None = None


class _Answer(BaseModel):
    id: str
    created: int
    model: str


class Completion(_Answer):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason


class ChatCompletion(_Answer):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "draining", "failed"]
    running: int
    largest_batch: int
    decode_steps: int
    processes: int


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="ignore")

    text: NonEmpty


MAX_DOCUMENTS = 1000  # per rerank request: every candidate is a prefill


class RerankRequest(BaseModel):
    """The rerank schema of Cohere, Jina and vLLM: a query and candidate documents (strings, or
    objects with "text"); the answer lists them best first."""
    model_config = ConfigDict(extra="ignore")

    model: Optional[StrictStr] = None
    query: NonEmpty
    documents: Annotated[list[Union[NonEmpty, RerankDocument]], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: Optional[Count] = None
    return_documents: Optional[StrictBool] = True

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int
    # exp(mean log-probability of the query's tokens given the document): in (0, 1], higher is better,
    # and the same document scores the same whatever else is in the request
    relevance_score: float
    document: Optional[RerankDocument] = None


class RerankUsage(BaseModel):
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    results: list[RerankResult]
    usage: RerankUsage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorDetail
