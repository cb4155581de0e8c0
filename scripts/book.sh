#!/usr/bin/env bash
# Builds the book (docs/, mdBook) into target/book. Installs mdBook from crates.io with cargo when
# the pinned version is not on the PATH (into cargo's bin folder, so later runs find it).
set -euo pipefail
cd "$(dirname "$0")/.."
MDBOOK_VERSION=0.5.4
if ! mdbook --version 2>/dev/null | grep -q "v$MDBOOK_VERSION"; then
  echo "installing mdbook $MDBOOK_VERSION (cargo install)"
  cargo install mdbook --version "$MDBOOK_VERSION" --locked --no-default-features --features search --quiet
fi
mdbook build docs
