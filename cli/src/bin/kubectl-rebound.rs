//! `kubectl-rebound`: the same program, found by kubectl as the plugin `kubectl rebound`.

fn main() -> std::process::ExitCode {
    rebound_cli::main()
}
