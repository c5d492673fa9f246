//! The Kubernetes manifests under `deploy/kubernetes/` as they ship:
//! - every object validates offline against the Kubernetes JSON schemas (PyPI `kubernetes-validate`,
//!   strict: an unknown field fails), for the oldest release the manifests claim (1.30: the kubelet's
//!   `sleep` preStop action) and a current one;
//! - the Prometheus-operator ServiceMonitor, a CRD no Kubernetes schema knows, is checked field by field
//!   against what the operator requires and against the Service it must select;
//! - every kustomization lists files that exist, and every manifest is in a kustomization or `optional/`;
//! - the picker's configuration passes `cachepick check`, and the Envoy ConfigMap's bootstrap is
//!   byte for byte what `cachepick envoy-config` writes for it (its header's command, run) and passes
//!   the real Envoy's validation.

#![allow(clippy::unwrap_used, clippy::expect_used)]
#![allow(clippy::indexing_slicing, clippy::panic)]

mod support {
    pub mod envoy;
    pub mod provision;
    pub mod shell;
}

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

use support::{envoy, provision, shell};

/// The Kubernetes releases the manifests are validated for.
const KUBERNETES: [&str; 2] = ["1.30.0", "1.34.0"];

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/kubernetes")
}

/// Every `*.yaml` under `dir`, sorted.
fn yaml_files(dir: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            found.extend(yaml_files(&path));
        } else if path.extension().is_some_and(|ext| ext == "yaml") {
            found.push(path);
        }
    }
    found.sort();
    found
}

fn is_kustomization(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name == "kustomization.yaml")
}

fn load(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::from_str(&text).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

fn service_monitor() -> PathBuf {
    deploy().join("optional/servicemonitor.yaml")
}

#[test]
fn every_manifest_validates_against_the_kubernetes_schemas() {
    let validator = provision::script(
        "provision-kubernetes-validate",
        "the manifest test validates deploy/kubernetes/ with it",
    );
    let manifests: Vec<PathBuf> = yaml_files(&deploy())
        .into_iter()
        .filter(|path| !is_kustomization(path) && *path != service_monitor())
        .collect();
    assert!(manifests.len() >= 12, "{manifests:?}");
    for version in KUBERNETES {
        let output = Command::new(&validator)
            .args(["--strict", "--kubernetes-version", version])
            .args(&manifests)
            .output()
            .unwrap();
        let report = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        assert!(output.status.success(), "Kubernetes {version}:\n{report}");
        // Every object of every file was checked against a schema: none was skipped as unknown.
        for manifest in &manifests {
            let name = manifest.display().to_string();
            assert!(
                report
                    .lines()
                    .any(|line| line.contains(&name) && line.contains(" passed ")),
                "{name} was not validated against Kubernetes {version}:\n{report}"
            );
        }
        assert!(
            !report.contains("WARN") && !report.contains("ERROR"),
            "Kubernetes {version}:\n{report}"
        );
    }
}

/// The validator fails a manifest that breaks the schema: the test above can fail.
#[test]
fn the_validator_refuses_a_broken_manifest() {
    let validator = provision::script(
        "provision-kubernetes-validate",
        "the manifest test validates deploy/kubernetes/ with it",
    );
    let shipped = std::fs::read_to_string(deploy().join("envoy/deployment.yaml")).unwrap();
    let broken = shipped.replacen("replicas: 2", "replicas: two", 1);
    assert_ne!(broken, shipped);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("deployment.yaml");
    std::fs::write(&file, broken).unwrap();
    let output = Command::new(&validator)
        .args(["--strict", "--kubernetes-version", KUBERNETES[0]])
        .arg(&file)
        .output()
        .unwrap();
    assert!(!output.status.success(), "{output:?}");
    assert!(
        String::from_utf8_lossy(&output.stdout).contains("spec.replicas"),
        "{output:?}"
    );
}

#[test]
fn the_service_monitor_has_what_the_operator_requires_and_selects_the_metrics_service() {
    let monitor = load(&service_monitor());
    assert_eq!(monitor["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(monitor["kind"], "ServiceMonitor");
    assert!(monitor["metadata"]["name"].is_string());
    assert_eq!(monitor["metadata"]["namespace"], "llm");
    // spec.selector and spec.endpoints are the fields the operator's CRD requires.
    let wanted = monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("spec.selector.matchLabels");
    let endpoints = monitor["spec"]["endpoints"]
        .as_sequence()
        .expect("spec.endpoints");
    assert!(!wanted.is_empty() && !endpoints.is_empty());
    // The labels kustomize puts on every picker object must include the selector's...
    let kustomization = load(&deploy().join("kustomization.yaml"));
    let pairs = &kustomization["labels"][0]["pairs"];
    for (key, value) in wanted {
        assert_eq!(
            &pairs[key], value,
            "{key:?} is not a label of the picker's Services"
        );
    }
    // ...and the Service they select must have the port the endpoint names.
    let service = load(&deploy().join("service.yaml"));
    let ports: BTreeSet<&str> = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|port| port["name"].as_str())
        .collect();
    for endpoint in endpoints {
        let port = endpoint["port"].as_str().expect("endpoints[].port");
        assert!(ports.contains(port), "{port} not in {ports:?}");
        assert_eq!(endpoint["path"], "/metrics");
    }
    assert_eq!(
        service["metadata"]["name"], "cachepick",
        "the job name the alert rules select"
    );
}

#[test]
fn every_kustomization_lists_files_that_exist_and_every_manifest_is_listed() {
    let mut listed = BTreeSet::new();
    for kustomization in yaml_files(&deploy())
        .into_iter()
        .filter(|p| is_kustomization(p))
    {
        let dir = kustomization.parent().unwrap();
        let resources = load(&kustomization)["resources"].clone();
        for resource in resources.as_sequence().expect("resources") {
            let path = dir.join(resource.as_str().unwrap());
            assert!(
                path.is_file(),
                "{} lists {}",
                kustomization.display(),
                path.display()
            );
            listed.insert(path);
        }
    }
    for manifest in yaml_files(&deploy()) {
        if is_kustomization(&manifest) || manifest.starts_with(deploy().join("optional")) {
            continue;
        }
        assert!(
            listed.contains(&manifest),
            "{} is in no kustomization",
            manifest.display()
        );
    }
}

/// The picker's configuration, as the ConfigMap holds it.
fn picker_configuration() -> String {
    load(&deploy().join("configmap.yaml"))["data"]["cachepick.yaml"]
        .as_str()
        .expect("data.cachepick.yaml")
        .to_owned()
}

#[test]
fn the_picker_configuration_passes_check() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cachepick.yaml");
    std::fs::write(&file, picker_configuration()).unwrap();
    let output = Command::new(cachepick_rig::cachepick_binary())
        .args(["check", "--config"])
        .arg(&file)
        .output()
        .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_envoy_bootstrap_is_what_its_command_generates_and_envoy_accepts_it() {
    let shipped = load(&deploy().join("envoy/configmap.yaml"))["data"]["envoy.yaml"]
        .as_str()
        .expect("data.envoy.yaml")
        .to_owned();
    let command = shell::regenerate_command(&shipped).to_owned();
    assert!(
        command.starts_with("cachepick envoy-config --config cachepick.yaml ")
            && command.contains("--picker cachepick-replicas.llm.svc.cluster.local:9002"),
        "{command}"
    );
    // Run it as the header says, beside the picker's configuration saved as cachepick.yaml.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("cachepick.yaml"), picker_configuration()).unwrap();
    let output = shell::run(&command, dir.path());
    assert!(
        String::from_utf8_lossy(&output.stdout) == shipped,
        "deploy/kubernetes/envoy/configmap.yaml's bootstrap differs from `{command}`: regenerate it"
    );
    // The workers come from the pickers' EDS; the picker clusters resolve the headless Service.
    let bootstrap: Value = serde_yaml::from_str(&shipped).unwrap();
    let clusters = bootstrap["static_resources"]["clusters"]
        .as_sequence()
        .unwrap();
    for name in ["cachepick", "cachepick_xds"] {
        let cluster = clusters
            .iter()
            .find(|cluster| cluster["name"] == name)
            .unwrap_or_else(|| panic!("no {name} cluster"));
        assert_eq!(
            cluster["cluster_type"]["name"], "envoy.cluster.dns",
            "{name}"
        );
    }
    if let Err(error) = envoy::validate_yaml(&shipped) {
        panic!("{error}");
    }
    // The start-up probe asks the bootstrap's ready listener, on the port the container declares.
    let ready = bootstrap["static_resources"]["listeners"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|listener| listener["name"] == "ready")
        .expect("a ready listener (--envoy-ready)");
    let port = &ready["address"]["socket_address"]["port_value"];
    let deployment = load(&deploy().join("envoy/deployment.yaml"));
    let container = &deployment["spec"]["template"]["spec"]["containers"][0];
    let probe = &container["startupProbe"]["httpGet"];
    assert_eq!(
        probe["path"],
        cachepick::envoy_config::READY_PATH,
        "{container:?}"
    );
    let declared = container["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|declared| declared["name"] == probe["port"])
        .expect("the probe's port is declared");
    assert_eq!(&declared["containerPort"], port, "{container:?}");
}
