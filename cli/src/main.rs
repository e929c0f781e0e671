//! `rebound`; see the library for the commands.

fn main() -> std::process::ExitCode {
    rebound_cli::main()
}
