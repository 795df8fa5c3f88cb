"""Planning a run before it starts: the cost estimate every ``tmas run``, ``eval`` and ``sweep`` prints, and the
pilot that measures token rates on a few problems."""
