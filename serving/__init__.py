"""Plumbing every server process of Lightgate shares, owned by no room: start-up errors,
addresses and signals (startup.py), the HTTP app and server (http.py), the budget for
partly received packets (read_budget.py), accepting connections (accepting.py) within
the file-descriptor budget (fd_budget.py), and logging what recurs (rate_limited_log.py).
It imports none of the rooms; the store, the gateway and the command line import it."""
