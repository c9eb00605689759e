"""Stand-ins for the Determined 0.38.1 cluster that cannot run here (master, agent, Docker).

Determined's own CLI, SDK, harness, launchers and entrypoint chain run for real against them; each
module names the Determined source (determined-ai/determined at v0.38.1, ``path:line``) it follows.
``python -m tests.standin --root DIR`` starts a master and an agent for a person to try by hand.
"""
