"""The Python SDK, for notebooks and scripts on any machine that can reach the cluster's dashboard.

client.py   Client and connect(): jobs, nodes, plans and deployments through Ray's public HTTP APIs
handles.py  Job, Run, DataJob, BatchRun, Service: handles on what a Client submitted (logs, metrics, plots, export)
serve.py    deploy() and delete() of a Serve application
inputs.py   specs from objects, dicts or YAML files; job ids; API keys from the environment
evaluate.py evaluate(): perplexity of an export or a deployment on a dataset's held-out split (`pylon.evaluate`)
lm_eval.py  lm-evaluation-harness against a deployment: `pylon-completions`, HF tokenizer files for any export
"""

from pylon.sdk.client import Client, connect
from pylon.sdk.handles import BatchRun, DataJob, Job, Run, Service

__all__ = ["BatchRun", "Client", "DataJob", "Job", "Run", "Service", "connect"]
