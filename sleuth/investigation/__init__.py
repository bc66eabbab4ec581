"""The pieces of a `sleuth diagnose` investigation, beside the agent that runs them (sleuth/diagnose.py).

    request.py         what was asked (DiagnoseRequest) and the one-line error (DiagnoseError)
    inputs.py          input discovery: the run, its config (and why it could not be read), checkpoint, code;
                       configs and checkpoints found beside someone's code
    report_builder.py  report building: the Report model from the findings, chart, report files, trace

The agent steps (regression, playbook, reference, invariant checks, follow-up) stay in sleuth/diagnose.py.
"""
