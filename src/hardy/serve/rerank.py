"""`POST /v1/rerank`: query-likelihood re-ranking (hardy.infer.rerank) through the serving engine,
which scores the candidates between decode steps of the running generations."""
from __future__ import annotations

import asyncio
import math

from hardy.errors import HardyError
from hardy.infer.rerank import QLMScorer, ScoreRow
from hardy.serve.engine import Engine, ScoreRequest
from hardy.serve.schemas import RerankRequest
from hardy.serve.transport import ApiError, AsyncEvents, check_model_name, internal_error, submit_to_engine


class Reranker:
    def __init__(self, engine: Engine, tokenizer, model_name: str):
        self.engine, self.model_name = engine, model_name
        self.scorer = QLMScorer(engine.runner.model, tokenizer) if tokenizer is not None else None

    def _rows(self, body: RerankRequest) -> list[ScoreRow]:
        if self.scorer is None:
            raise ApiError(400, "this model has no tokenizer to read text with", "invalid_request_error")
        check_model_name(body.model, self.model_name)
        try:
            return self.scorer.score_rows(body.query, body.texts())
        except HardyError as e:
            raise ApiError(400, str(e), "invalid_request_error", "query") from None

    async def rerank(self, body: RerankRequest, request_id: str) -> dict:
        rows = self._rows(body)
        events = AsyncEvents(asyncio.get_running_loop())
        job = ScoreRequest(rows, self.scorer.pad_id, events=events)
        submit_to_engine(self.engine, job)
        kind, value = await events.get()
        if kind != "scores":
            raise internal_error("scoring failed", str(value), request_id)
        n_query = len(rows[0].target)
        order = sorted(range(len(rows)), key=lambda i: -value[i])[:body.top_n or len(rows)]
        texts = body.texts()
        results = [{"index": i, "relevance_score": math.exp(value[i] / n_query),
                    **({"document": {"text": texts[i]}} if body.return_documents else {})} for i in order]
        return {"id": request_id, "model": self.model_name, "results": results,
                "usage": {"total_tokens": sum(len(r.tokens) for r in rows)}}
