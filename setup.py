"""Packaging beyond pyproject.toml: the repository's configs/ (tree presets, shipped draft heads) goes
into the wheel as the package data folder jaxspec/configs, so an installed jaxspec finds them from the
package, whatever the current folder (`jaxspec.resources.configs_dir`). The distilled training data
(configs/distilled/) is for `jaxspec train` from a checkout and stays out of the wheel; the human-written
passages of `jaxspec train --prompt-source passages` (configs/prompts/, 65 kB) go in."""

from setuptools import find_namespace_packages, setup

setup(
    packages=find_namespace_packages(include=["jaxspec", "jaxspec.*", "pallas_kernels", "pallas_kernels.*"])
    + ["jaxspec.configs"],
    package_dir={"jaxspec.configs": "configs"},
    package_data={"jaxspec.configs": ["*.json", "heads/**/*", "prompts/*.jsonl"]},
)
