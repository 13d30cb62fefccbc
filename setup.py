from pathlib import Path

from setuptools import find_packages, setup

setup(
    name="aitoolbox",
    version="2.0.0.dev0",
    description="PyTorch training loop with mixed precision (apex amp API on torch.amp) and multi-device training",
    long_description=Path(__file__).with_name("README.rst").read_text(encoding="utf-8"),
    long_description_content_type="text/x-rst",
    license="MIT",
    packages=find_packages(include=["aitoolbox", "aitoolbox.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.3",
        "numpy",
        "scikit-learn>=1.2",
        "tqdm>=4.62",
    ],
    extras_require={
        # pytest pinned as hypothesis below: pytest 9.2 also captures a record at a logger given to caplog.set_level,
        # so a test of one warning saw it twice.
        "test": ["pytest==9.0.3", "tensorboard>=2.10", "matplotlib>=3.5", "nbclient>=0.7", "nbformat>=5",
                 "ipykernel>=6", "ipywidgets>=8", "sphinx>=7", "sphinx-rtd-theme>=2", "pillow>=9",
                 # The cloud and tracking tests run against real local servers and offline stores.
                 "boto3>=1.28.57", "moto[server]>=5", "google-cloud-storage>=2.10", "gcp-storage-emulator",
                 "wandb>=0.17", "mlflow-skinny>=2.10", "sqlalchemy>=2.0", "alembic>=1.13",
                 "rouge-score>=0.1.2", "sacrebleu>=2.0", "nltk>=3.8",
                 # Mid-epoch resume of torchdata's StatefulDataLoader.
                 "torchdata>=0.10",
                 # The property-based tests (tests/combinations/test_properties.py and others). Pinned: their
                 # derandomized examples depend on hypothesis's version, and CI's verdict must be reproducible.
                 "hypothesis==6.155.2"],
        "tracking": ["tensorboard>=2.10", "matplotlib>=3.5"],
        # Cloud storage of experiments: AWS S3 (and S3-compatible stores), Google Cloud Storage.
        "aws": ["boto3>=1.28.57"],
        "gcs": ["google-cloud-storage>=2.10"],
        "wandb": ["wandb>=0.17"],
        "mlflow": ["mlflow-skinny>=2.10"],
        # aitoolbox.nlp's metrics: ROUGE, BLEU (token and text), heat maps.
        "nlp": ["rouge-score>=0.1.2", "sacrebleu>=2.0", "nltk>=3.8", "matplotlib>=3.5"],
        # Jupyter: progress bars as widgets (tqdm.auto falls back to text bars without ipywidgets).
        "notebook": ["ipywidgets>=8"],
        "examples": ["matplotlib>=3.5", "torchvision", "pillow>=9"],
        "docs": ["sphinx>=7", "sphinx-rtd-theme>=2"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
