"""Register ftflow's deployments with a Prefect work pool, for a cluster:

    PREFECT_API_URL=https://prefect.example.com/api python -m deployments.deploy --pool ftflow

A process pool's workers run each flow where ftflow is installed (infra/prefect/worker.yaml: a
worker in ftflow's image); for a pool that starts a container per run (Kubernetes, Docker), name
the image with --image. Either way the flows reach Ray through RAY_ADDRESS in the worker's or the
job's environment. Nothing is built or pushed here: the image comes from infra/docker/Dockerfile.
"""

import argparse

from prefect import deploy

from deployments.definitions import deployments, limit_concurrency

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--pool", required=True, help="work pool name")
    parser.add_argument("--image", help="for container pools: the image holding ftflow and its pinned stack")
    args = parser.parse_args()
    limit_concurrency()
    deploy(*deployments(), work_pool_name=args.pool, image=args.image, build=False, push=False, ignore_warnings=True)
