//! Static checks that keep the Dockerfile in step with the workspace and the chart; the image itself
//! is built and run by scripts/build-image.sh and tests/podman/test_image.py.

use memguard_e2e::{chart_dir, workspace_root};

fn dockerfile() -> String {
    std::fs::read_to_string(workspace_root().join("Dockerfile")).expect("Dockerfile")
}

/// `[[bin]] name = "…"` of a crate's manifest.
fn bin_names(crate_dir: &str) -> Vec<String> {
    let manifest = std::fs::read_to_string(workspace_root().join(crate_dir).join("Cargo.toml"))
        .expect("manifest");
    manifest
        .split("[[bin]]")
        .skip(1)
        .filter_map(|section| {
            section.lines().find_map(|l| {
                l.trim()
                    .strip_prefix("name = ")
                    .map(|n| n.trim_matches('"').to_string())
            })
        })
        .collect()
}

#[test]
fn image_builds_and_ships_the_three_binaries_the_workspace_declares() {
    let docker = dockerfile();
    // The sidecar ships from its own profile (panic = "abort", smaller); see Cargo.toml.
    for (dir, package, profile) in [
        ("webhook", "memguard-webhook", "release"),
        ("sidecar", "memguard-sidecar", "sidecar"),
        ("cli", "memguard", "release"),
    ] {
        let bins = bin_names(dir);
        assert_eq!(bins, [package], "{dir}/Cargo.toml binaries");
        assert!(
            docker.contains(&format!("-p {package}")),
            "Dockerfile does not build {package}"
        );
        assert!(
            docker.contains(&format!("target/{profile}/{package}")),
            "Dockerfile does not copy {package} from target/{profile}"
        );
    }
    assert!(docker.contains("COPY --from=build /out/ /usr/local/bin/"));
    assert!(
        docker.contains("--locked"),
        "the image builds from Cargo.lock"
    );
}

#[test]
fn image_runs_as_the_non_root_user_the_chart_expects() {
    let docker = dockerfile();
    let last_from = docker.rfind("\nFROM ").expect("a final stage");
    let runtime = &docker[last_from..];
    assert!(runtime.contains("distroless"), "minimal runtime image");
    assert!(runtime.contains("USER 65532:65532"));
    let deployment =
        std::fs::read_to_string(chart_dir().join("templates/deployment.yaml")).expect("template");
    assert!(deployment.contains("- /usr/local/bin/memguard-webhook"));
    assert!(deployment.contains("runAsUser: 65532"));
}
