//! `kubectl_complete-rebound`: completes `kubectl rebound …` words for kubectl's shell
//! completion.

fn main() -> std::process::ExitCode {
    rebound_cli::main()
}
