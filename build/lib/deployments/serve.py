"""The local stack's runner: serves ftflow's deployments from this process, so scheduled runs and
runs triggered from the UI execute here (each in a subprocess). `make stack-up` starts it with
PREFECT_API_URL and RAY_ADDRESS naming the stack's server and Ray head."""

from prefect import serve

from deployments.definitions import deployments, limit_concurrency

if __name__ == "__main__":
    limit_concurrency()
    serve(*deployments())
