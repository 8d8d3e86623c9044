"""Requests whose grammar is still compiling (status WAITING_FOR_FSM), kept out of the waiting queue so that they
hold back no one; each step the scheduler takes in those whose grammar is ready."""
from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from raylm.cluster.request import Request, RequestStatus


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

    def pop_ready(self) -> list[Request]:
        """The requests whose grammar has compiled (or failed to: see StructuredOutputRequest.error), in arrival
        order, back in status WAITING."""
        if not self.requests:
            return []
        ready = [r for r in self.requests if r.structured_output_request is None or
                 r.structured_output_request.is_ready()]
        if ready:
            self.requests = [r for r in self.requests if r not in ready]
            for request in ready:
                request.status = RequestStatus.WAITING
        return ready

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
