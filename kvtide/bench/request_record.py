"""RequestRecord: what the client observed for one request of a `kvtide bench` run, the input of
every figure (metrics.py, structured_figures.py, plots.py)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class RequestRecord:
    """What the client observed for one request. Times are seconds (time.perf_counter)."""

    prompt_len: int
    """Prompt tokens (the server's usage.prompt_tokens when it reports it, else our count)."""
    expected_output_len: int
    """max_tokens asked for."""
    start_time: float = 0.0
    """When the request was sent."""
    chunk_times: list[float] = field(default_factory=list)
    """Arrival time of every chunk that carried a token, in order."""
    end_time: float = 0.0
    """When the stream ended ([DONE] or its last byte)."""
    output_len: int = 0
    """Output tokens (usage.completion_tokens when reported, else the number of token chunks)."""
    success: bool = False
    error: str = ""
    generated_text: str = ""
    finish_reason: str | None = None
    conversation_id: int | None = None
    turn: int | None = None
    structured_outputs: dict | None = None
    """The constraint the request sent (vLLM's structured_outputs object); None: unconstrained."""

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start_time if self.chunk_times else None

    @property
    def e2el(self) -> float:
        return self.end_time - self.start_time

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        ttft = self.ttft
        if ttft is None or self.output_len < 2:
            return None
        return (self.e2el - ttft) / (self.output_len - 1)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft=self.ttft, tpot=self.tpot, e2el=self.e2el)
        return d
