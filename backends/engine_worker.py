"""A local engine's worker process: one GGUF file, loaded once, serving the gateway over a pipe.

Started by ``backends.engine_host`` as ``python -m backends.engine_worker``; nothing else should
run it. It holds the file's weights once and one llama.cpp context per engine the gateway opens
on it (the ``llamacpp`` chat backend: a ``llama_cpp.Llama``; the ``gguf_scorer``: a
``ChatScorer`` on the same model; the ``gguf_probe``: a ``HiddenReader`` in embedding mode, on weights
of its own), each context with a thread of its own that takes its jobs in
order. A native fault here ends this process only: the gateway fails or retries what was in
flight and starts another.

Protocol: ``backends.engine_wire``. The main thread reads frames from stdin and hands jobs to the
engines' threads; every thread writes its replies under one lock.
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import orjson

from backends.engine_wire import frame, frame_length, question_from_wire, scores_to_wire

# What a job's failure is: "invalid" (the request's fault: a 400), "upstream" (the engine's: a 502).
INVALID, UPSTREAM = "invalid", "upstream"


class Cancelled(Exception):
    pass


@dataclass
class Job:
    id: int
    method: str
    args: dict[str, Any]
    stream: bool
    cancel: threading.Event = field(default_factory=threading.Event)


class Wire:
    def __init__(self, out: BinaryIO) -> None:
        self.out = out
        self.lock = threading.Lock()

    def send(self, message: dict[str, Any]) -> None:
        data = frame(message)
        with self.lock:
            self.out.write(data)
            self.out.flush()


class Engine:
    """One context, one thread, its jobs in order."""

    def __init__(self, eid: str, wire: Wire, index: dict[int, Job]) -> None:
        self.eid = eid
        self.wire = wire
        self.index = index  # the host's jobs by id (what a cancel finds), each dropped when it ends
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"engine-{eid}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _loop(self) -> None:
        while (job := self.jobs.get()) is not None:
            if job.cancel.is_set():
                self.index.pop(job.id, None)
                self.wire.send({"ev": "error", "id": job.id, "kind": "cancelled", "message": "cancelled"})
                continue
            self.wire.send({"ev": "started", "id": job.id})
            try:
                self.wire.send({"ev": "done", "id": job.id, "data": self.run(job)})
            except Cancelled:
                self.wire.send({"ev": "error", "id": job.id, "kind": "cancelled", "message": "cancelled"})
            except Exception as exc:  # the worker's edge: every failure becomes an error frame
                self.wire.send({"ev": "error", "id": job.id, **_classify(exc)})
            finally:
                self.index.pop(job.id, None)

    def run(self, job: Job) -> Any:
        raise NotImplementedError


def _classify(exc: Exception) -> dict[str, str]:
    import jinja2

    from backends.lettered import LetteredInputError
    from backends.logprob import PromptTooLong

    if isinstance(exc, PromptTooLong | LetteredInputError):
        return {"kind": INVALID, "message": str(exc)}
    if isinstance(exc, ValueError | TypeError | KeyError | jinja2.TemplateError):
        return {"kind": INVALID, "message": f"the local model cannot take this request: {exc}"}
    return {"kind": UPSTREAM, "message": f"{type(exc).__name__}: {exc}"}


class ChatEngine(Engine):
    """``llama_cpp.Llama``: chat and text completions, streamed or whole; a job is stopped at its
    next token when cancelled (a stopping criterion llama-cpp-python checks every token)."""

    def __init__(self, eid: str, wire: Wire, index: dict[int, Job], llm: Any) -> None:
        super().__init__(eid, wire, index)
        self.llm = llm

    def run(self, job: Job) -> Any:
        kwargs = dict(job.args)
        grammar = kwargs.pop("grammar", None)
        if grammar is not None:
            from llama_cpp import LlamaGrammar

            kwargs["grammar"] = LlamaGrammar.from_string(grammar, verbose=False)
        self.llm.cancel = job.cancel
        fn = self.llm.create_chat_completion if job.method == "chat" else self.llm.create_completion
        if not job.stream:
            out = fn(**kwargs, stream=False)
            if job.cancel.is_set():
                raise Cancelled
            return out
        for chunk in fn(**kwargs, stream=True):
            if job.cancel.is_set():
                raise Cancelled
            self.wire.send({"ev": "chunk", "id": job.id, "data": chunk})
        return {"n_tokens": self.llm.n_tokens}


class ScorerEngine(Engine):
    def __init__(self, eid: str, wire: Wire, index: dict[int, Job], scorer: Any) -> None:
        super().__init__(eid, wire, index)
        self.scorer = scorer

    def run(self, job: Job) -> Any:
        a = job.args
        self.scorer.cancelled = job.cancel.is_set
        if job.method == "score":
            got = self.scorer.score(a["prompt"], list(a["options"]))
        elif job.method == "score_question":
            got = self.scorer.score_question(question_from_wire(a["question"]), int(a.get("reason_tokens") or 0))
        elif job.method == "answer":  # the router's probe, reading: answer
            steps = self.scorer.answer_steps(str(a["text"]), int(a["limit"]))
            if job.cancel.is_set():
                raise Cancelled
            return asdict(steps)
        else:
            raise ValueError(f"unknown method {job.method!r}")
        if job.cancel.is_set():
            raise Cancelled
        return scores_to_wire(got)


class HiddenEngine(Engine):
    """``backends.hidden.HiddenReader``: a prompt's mean-pooled final hidden state (the learned
    router's difficulty probe), one prefill and no generation."""

    def __init__(self, eid: str, wire: Wire, index: dict[int, Job], reader: Any) -> None:
        super().__init__(eid, wire, index)
        self.reader = reader

    def run(self, job: Job) -> Any:
        if job.method != "read":
            raise ValueError(f"unknown method {job.method!r}")
        vector, tokens = self.reader.read(str(job.args["text"]))
        if job.cancel.is_set():
            raise Cancelled
        return {"vector": vector.tolist(), "tokens": tokens}


def _cancellable_llama() -> type:
    """``llama_cpp.Llama`` whose completions also stop when the current job is cancelled."""
    from llama_cpp import Llama, StoppingCriteriaList

    class CancellableLlama(Llama):
        cancel: threading.Event | None = None

        def create_completion(self, *args: Any, **kwargs: Any) -> Any:
            event = self.cancel
            criteria = kwargs.get("stopping_criteria")
            stop_now = lambda ids, logits: event is not None and event.is_set()  # noqa: E731
            kwargs["stopping_criteria"] = StoppingCriteriaList([*(criteria or []), stop_now])
            return super().create_completion(*args, **kwargs)

    return CancellableLlama


class Host:
    """The file's model, loaded once, and the engines on it."""

    def __init__(self, path: Path, wire: Wire) -> None:
        self.path = path
        self.wire = wire
        self.engines: dict[str, Engine] = {}
        self.llm: Any = None  # a Llama, when a chat engine asked first: its model is shared
        self.model: Any = None  # the loaded llama_model (internals.LlamaModel)
        self.jobs: dict[int, Job] = {}

    def open(self, m: dict[str, Any]) -> None:
        eid = m["engine"]
        try:
            engine = self._make(eid, m)
            self._probe(engine)
        except Exception as exc:  # reported as the engine's reason, the worker keeps serving the others
            detail = "".join(traceback.format_exception_only(exc)).strip()
            self.wire.send({"ev": "open_failed", "engine": eid, "message": detail})
            return
        self.engines[eid] = engine
        engine.start()
        self.wire.send({"ev": "opened", "engine": eid, "n_ctx_train": self._n_ctx_train()})

    def _n_ctx_train(self) -> int:
        return int(self.model.n_ctx_train()) if self.model is not None else 0

    def _make(self, eid: str, m: dict[str, Any]) -> Engine:
        n_ctx, n_threads, n_batch = int(m["n_ctx"]), int(m["n_threads"]), int(m["n_batch"])
        if m["kind"] == "chat":
            llm = _cancellable_llama()(
                model_path=str(self.path),
                n_ctx=n_ctx,
                n_threads=n_threads,
                n_threads_batch=n_threads,
                n_batch=n_batch,
                chat_format=m.get("chat_format"),
                verbose=False,
            )
            if self.model is None:
                self.llm, self.model = llm, llm._model
            return ChatEngine(eid, self.wire, self.jobs, llm)
        if m["kind"] == "hidden":  # a context of its own in embedding mode, on weights of its own
            from backends.hidden import HiddenReader

            return HiddenEngine(eid, self.wire, self.jobs, HiddenReader(self.path, n_ctx, n_threads, n_batch))
        from backends.lettered import ChatScorer

        if self.model is None:
            from backends.logprob import load_model

            self.model = load_model(self.path)
        scorer = ChatScorer(self.path, n_ctx, n_threads, n_batch, model=self.model)
        return ScorerEngine(eid, self.wire, self.jobs, scorer)

    @staticmethod
    def _probe(engine: Engine) -> None:
        """One token through the new context: a kernel that faults does so here, at load, where
        the gateway marks the model unhealthy with the reason instead of failing a request."""
        if isinstance(engine, ChatEngine):
            engine.llm.create_completion("Hello", max_tokens=1, temperature=0.0)
        elif isinstance(engine, ScorerEngine):
            engine.scorer.score("Hello", [" world"])
        elif isinstance(engine, HiddenEngine):
            engine.reader.read("Hello")

    def dispatch(self, m: dict[str, Any]) -> None:
        op = m["op"]
        if op == "open":
            self.open(m)
        elif op == "run":
            job = Job(int(m["id"]), m["method"], m.get("args") or {}, bool(m.get("stream")))
            engine = self.engines.get(m["engine"])
            if engine is None:
                self.wire.send({"ev": "error", "id": job.id, "kind": UPSTREAM, "message": "engine is not open"})
                return
            self.jobs[job.id] = job
            engine.jobs.put(job)
        elif op == "cancel":
            cancelled = self.jobs.get(int(m["id"]))
            if cancelled is not None:
                cancelled.cancel.set()
        elif op == "close":
            engine = self.engines.pop(m["engine"], None)
            if engine is not None:
                engine.jobs.put(None)
        else:
            raise ValueError(f"unknown op {op!r}")


def _frames(stream: BinaryIO) -> Iterator[dict[str, Any]]:
    while True:
        header = stream.read(4)
        if len(header) < 4:
            return
        n = frame_length(header)
        data = stream.read(n)
        if len(data) < n:
            return
        yield orjson.loads(data)


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    path = Path(args[0])
    # The protocol gets the stdout we were given; fd 1 becomes stderr, so nothing native ever
    # writes into a frame.
    proto = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    # the gateway decides when this process ends (its stdin closes): a Ctrl-C in the terminal
    # reaches the whole process group, and must not kill the engine under a draining gateway
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from llama_cpp._logger import set_verbose

    set_verbose(False)
    wire = Wire(proto)
    host = Host(path, wire)
    wire.send({"ev": "hello", "pid": os.getpid()})
    for message in _frames(sys.stdin.buffer):
        host.dispatch(message)
    os._exit(0)  # stdin closed: the gateway is gone or done with us; no teardown under native calls


if __name__ == "__main__":
    main()
