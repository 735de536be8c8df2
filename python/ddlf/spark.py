"""Spark as ddlf's data supplier (lives in :mod:`ddlf.integrations.spark`)."""

from __future__ import annotations

from .integrations.spark import SparkApp, export, hosted, partition

__all__ = ["SparkApp", "export", "hosted", "partition"]
