"""Requests whose grammar is still compiling (status WAITING_FOR_FSM), kept out of the waiting queue so that they
hold back no one; each step the scheduler takes in those whose grammar is ready."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from raylm.cluster.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from raylm.cluster.core.structured_output.manager import StructuredOutputManager


class GrammarWaitList:
    def __init__(self) -> None:
        self.requests: list[Request] = []

    def add(self, request: Request) -> bool:
        """Keep a constrained request here until the next schedule() looks at its grammar; False for the others."""
        if request.structured_output_request is None:
            return False
        request.status = RequestStatus.WAITING_FOR_FSM
        self.requests.append(request)
        return True

    def pop_ready(self, manager: StructuredOutputManager | None) -> tuple[list[Request], list[Request]]:
        """The requests whose grammar is done, in arrival order: (those to queue, back in status WAITING; those it
        ends, finished: an error when it failed to compile (the server's failure, not the client's abort), stopped
        when it allows only a stop token that min_tokens forbids)."""
        if not self.requests:
            return [], []
        done = [r for r in self.requests if r.structured_output_request is None or
                r.structured_output_request.is_ready()]
        self.requests = [r for r in self.requests if r not in done]
        ready, ended = [], []
        for request in done:
            structured = request.structured_output_request
            error = structured.error() if structured is not None else None
            if error is None and not (manager is not None and manager.ends_before_start(request)):
                request.status = RequestStatus.WAITING
                ready.append(request)
                continue
            request.status = RequestStatus.FINISHED_ERROR if error else RequestStatus.FINISHED_STOPPED
            request.stop_reason = error
            ended.append(request)
        return ready, ended

    def wait(self, timeout: float) -> None:
        """Block until a grammar is ready (at most `timeout` s): the engine has nothing else to run."""
        futures = [r.structured_output_request.compiled for r in self.requests if r.structured_output_request]
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    def remove(self, request: Request) -> bool:
        if request in self.requests:
            self.requests.remove(request)
            return True
        return False

    def __len__(self) -> int:
        return len(self.requests)
