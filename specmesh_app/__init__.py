"""The application shell: the ``specmesh`` command line, the benchmark, training tools, local launchers.

It sits above every floor (orchestrator, drafter and verifier services, the core) and is
imported by nothing below it.
"""
