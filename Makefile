# Developer tasks. `make help` lists them; `make presubmit` is what CI runs.
.PHONY: help fmt lint test bench fuzz presubmit

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

fmt: ## Format the code
	cargo fmt --all

lint: ## Check formatting and run clippy with warnings as errors
	cargo fmt --all -- --check
	cargo clippy --locked --all-targets -- -D warnings

test: ## Run every test: unit, property, integration and doc tests
	cargo test --locked

bench: ## Run the criterion benchmarks
	cargo bench --locked

# cargo-fuzz passes sanitizer flags that only nightly accepts; RUSTC_BOOTSTRAP lets the pinned stable
# toolchain take them, since no other toolchain can be installed on the project's machines.
fuzz: ## Fuzz each target for FUZZ_SECONDS (default 60); needs `cargo install cargo-fuzz`
	cd fuzz && for target in $$(cargo fuzz list); do \
		RUSTC_BOOTSTRAP=1 cargo fuzz run $$target -- -max_total_time=$${FUZZ_SECONDS:-60} || exit 1; \
	done

presubmit: ## What CI runs
	bash .ci/run
