# A lean_transformer swarm peer on a CUDA GPU.
#
#   docker build -t lean-transformer .
#   docker run --gpus all --ulimit nofile=65536:65536 --shm-size 16g --stop-timeout 60 -p 31337:31337 \
#       -v "$PWD/identity:/app/identity" -v "$PWD/outputs:/app/outputs" \
#       lean-transformer python run_trainer.py --run_id my_run --host_maddrs /ip4/0.0.0.0/tcp/31337 \
#       --identity_path identity/trainer.id --initial_peers /ip4/1.2.3.4/tcp/31337/p2p/QmPeer
#   docker run --ulimit nofile=65536:65536 --shm-size 16g --stop-timeout 60 -p 31337:31337 \
#       -v "$PWD/identity:/app/identity" -v "$PWD/outputs:/app/outputs" \
#       lean-transformer python run_aux_peer.py --run_id my_run --host_maddrs /ip4/0.0.0.0/tcp/31337 \
#       --identity_path identity/aux.id
#
# The commands run in /app, the project's root, so the README's `python run_trainer.py ...` and
# `python run_aux_peer.py ...` work unchanged after `IMAGE`.
#   Port 31337/tcp: the libp2p port; pass the same port in --host_maddrs /ip4/0.0.0.0/tcp/31337 and publish it
#     (-p 31337:31337, or --network host). Peers behind NAT can skip it and use --client_mode.
#   /app/identity: the peer's identity key (--identity_path identity/peer.id) and, in an authorized swarm, its
#     access token and the authority's public key. Keep it across runs: it is the peer's ID and its token binding.
#   /app/outputs: trainer backups (--output_dir, default outputs/trainer), aux peer checkpoints
#     (--checkpoint_dir, default outputs/aux/checkpoints) and offline wandb runs.

# The official PyTorch runtime image: CUDA, cuDNN, Python 3.11 and a CUDA build of torch. For an older NVIDIA driver,
# pick an older CUDA: --build-arg BASE_IMAGE=pytorch/pytorch:2.7.1-cuda11.8-cudnn9-runtime
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE_IMAGE}

# PIP_CONSTRAINT pins torch to the image's own CUDA build for every pip install, this one and any a user runs
# later, so the project's dependencies can never swap it for a wheel from PyPI.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_CONSTRAINT=/etc/pip-constraints.txt \
    WANDB_DIR=/app/outputs

WORKDIR /app

# Dependencies first, in their own layer, so that editing the source does not reinstall them.
COPY pyproject.toml ./
RUN python -c "import torch; print('torch==' + torch.__version__)" > /etc/pip-constraints.txt \
 && python -c "import tomllib; project = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print(*project['dependencies'], *project['optional-dependencies']['cuda'], sep='\n')" \
        > /tmp/requirements.txt \
 && pip install --requirement /tmp/requirements.txt \
 && rm /tmp/requirements.txt

COPY . .
RUN pip install --no-deps . \
 && python -c "import hivemind, bitsandbytes, lean_transformer, torch; print(torch.__version__, torch.version.cuda)" \
 && mkdir -p identity outputs

EXPOSE 31337/tcp
VOLUME ["/app/identity", "/app/outputs"]

CMD ["python", "run_trainer.py", "--help"]
