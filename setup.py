from setuptools import find_packages, setup

TF_VERSION = ">=2.16"  # the first TensorFlow whose tf.keras is Keras 3
HUB_LIGHT = ["absl-py", "packaging", "regex", "rich", "kagglehub", "sentencepiece", "tokenizers", "grain"]

setup(
    name="tpu_magic",
    version="0.1.0",
    description="IPython magics that train the Keras model in a notebook cell on a TPU, GPU or CPU.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["tpu_magic", "tpu_magic.*"]),
    python_requires=">=3.10",
    # One flavour each: safe to depend on directly.
    install_requires=["ipython>=8", "ipywidgets>=8", "tqdm>=4.66", "keras>=3", "numpy", "h5py"],
    # TensorFlow comes in flavours that conflict when two are installed: pick one.
    extras_require={
        "tf": [f"tensorflow{TF_VERSION}"],
        "cpu": [f"tensorflow-cpu{TF_VERSION}"],
        # A TPU VM (Colab v5e-1/v6e-1, Kaggle v5e-8/v6e-8, Cloud TPU VMs): Keras on JAX.
        # Colab's and Kaggle's images already have it; nothing beyond tpu_magic is needed there.
        "tpu": ["jax[tpu]>=0.4.30", "orbax-checkpoint"],
        # TensorFlow's own TPU build, for `--backend tf` on a TPU VM without JAX (never beside
        # JAX's libtpu: the two take the same chips).
        "tf-tpu": [f"tensorflow-tpu{TF_VERSION}"],
        "test": ["pytest>=8", "pytest-timeout", "hypothesis", "scikit-learn", "nbclient", "nbformat", "ipykernel",
                 # KerasHub's small-config language models (dev.sh installs keras-hub itself
                 # without its tensorflow-text, which would pull the full tensorflow wheel
                 # beside tensorflow-cpu): what it imports, and grain, its TF-free data loader.
                 *HUB_LIGHT, "ipyparallel>=8.6", "orbax-checkpoint"],
        # KerasHub language models (Gemma, Llama, Qwen, Mistral) for `--shard model`; Kaggle's
        # and Colab's images have it already.
        "hub": ["keras-hub>=0.20", "grain"],
        # Several hosts (`%tpu_connect --hosts/--simulate HxD`): IPython's engines, one a host.
        "hosts": ["ipyparallel>=8.6", "jax>=0.4.30", "orbax-checkpoint"],
        # The documentation site (`bash dev.sh docs`): MkDocs, its Material theme, and
        # mkdocs-jupyter for the executed example notebooks.
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocs-jupyter>=0.24"],
        # The panel's real-browser test drives Debian's chromium (apt), not a downloaded one.
        "browser": ["jupyterlab>=4", "playwright>=1.40"],
        # Keras on JAX (`%tpu_connect --backend jax`); on a TPU VM: pip install "jax[tpu]".
        # orbax-checkpoint writes the checkpoints of a model split over devices or hosts.
        "jax": ["jax>=0.4.30", "orbax-checkpoint"],
        # The example notebooks' plots and their stand-in data.
        "examples": ["matplotlib", "scikit-learn"],
    },
    classifiers=["Framework :: IPython", "Framework :: Jupyter", "Programming Language :: Python :: 3"],
)
