"""Reward functions shipped with tidal, usable by import path in `reward_funcs[]` (TRL's interface), and
`ServiceUnavailable`, what a reward function (an environment, a tool) raises when a service it depends on cannot
be reached."""

from __future__ import annotations


class ServiceUnavailable(Exception):
    """An external service a reward function, environment or tool depends on (an LLM judge, a sandbox service, an
    environment server) is unreachable: refused connections, server errors (5xx), timeouts. Raise it instead of
    returning a score: the affected rollouts were not judged, so they carry no loss and stay out of their group's
    baseline, and when most of a step's rollouts fail this way the orchestrator waits for the service (orch
    `env_outage`; docs/orchestrator.md, "Environment failures vs model failures"). Not for the model's own doing
    (an invalid answer, code the model wrote that crashes or hangs in a sandbox): those score as usual.

    `service` names it for the logs, e.g. `"LLM judge at http://judge:8000"`."""

    def __init__(self, service: str, detail: str = "") -> None:
        super().__init__(f"{service} is unavailable" + (f" ({detail})" if detail else ""))
        self.service, self.detail = service, detail
