"""The ``tmas`` command line (typer): one module per command group, the option groups they share (``options``) and
the cost estimate's flags and gate (``estimate``). It parses flags into settings and calls the layers below; no
logic of a method, a grader or a report lives here."""
