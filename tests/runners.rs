//! The test-runner parser on output captured from the real runners (tests/fixtures/runners/,
//! see its README for versions and commands).

use loopd_core::test_output::{TestCounts, parse_test_output, test_result};

fn parsed(file: &str) -> Option<TestCounts> {
    let path = format!(
        "{}/tests/fixtures/runners/{file}",
        env!("CARGO_MANIFEST_DIR")
    );
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    parse_test_output(&text)
}

#[track_caller]
fn expect(file: &str, passed: Option<u64>, failed: u64, names: &[&str]) {
    let c = parsed(file).unwrap_or_else(|| panic!("{file}: nothing recognised"));
    assert_eq!((c.passed, c.failed), (passed, failed), "{file}");
    assert_eq!(c.failed_tests, names, "{file}");
}

#[test]
fn cargo_libtest() {
    expect("cargo-fail.txt", Some(2), 1, &["tests::multiplies"]);
    expect("cargo-pass.txt", Some(3), 0, &[]);
    expect("cargo-two-binaries.txt", Some(4), 1, &["mul_by_zero"]);
}

#[test]
fn pytest() {
    let name = ["tests/test_calc.py::test_multiplies"];
    expect("pytest-fail.txt", Some(2), 1, &name);
    expect("pytest-q-fail.txt", Some(2), 1, &name);
    expect("pytest-pass.txt", Some(3), 0, &[]);
}

#[test]
fn jest() {
    let name = ["product › multiplies 3 * 4 to equal 12"];
    expect("jest-fail.txt", Some(3), 1, &name);
    expect("jest-two-suites-fail.txt", Some(4), 1, &name);
    expect("jest-pass.txt", Some(4), 0, &[]);
}

#[test]
fn go_test() {
    expect("go-v-fail.txt", Some(2), 1, &["TestMultiplies"]);
    expect("go-v-pass.txt", Some(3), 0, &[]);
    // Without -v, go says nothing of the tests that pass.
    expect("go-fail.txt", None, 1, &["TestMultiplies"]);
    assert_eq!(parsed("go-pass.txt"), None);
}

#[test]
fn validate_results_from_real_output() {
    let text = std::fs::read(format!(
        "{}/tests/fixtures/runners/pytest-fail.txt",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let r = test_result(false, &text);
    assert_eq!(r.state_updates["passed"], false);
    assert_eq!(r.state_updates["pass_rate"], 66.7);
    assert_eq!(r.summary, "2 passed, 1 failed");
    let text = std::fs::read(format!(
        "{}/tests/fixtures/runners/go-fail.txt",
        env!("CARGO_MANIFEST_DIR")
    ))
    .unwrap();
    let r = test_result(false, &text);
    assert_eq!(
        r.state_updates["pass_rate"], 0.0,
        "unknown passes: the exit code decides"
    );
    assert_eq!(r.summary, "1 failed");
}
