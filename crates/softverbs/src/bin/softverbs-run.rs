//! `softverbs-run COMMAND [ARGS...]`: run a verbs program on the softverbs
//! userspace device (root; see `softverbs::launcher`). `--help` prints the
//! usage, the trust model and the environment it reads.

fn main() {
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    if args.first().is_some_and(|a| a == "--help" || a == "-h") {
        print!("{}", softverbs::launcher::HELP);
        return;
    }
    match softverbs::launcher::launch(args) {
        Ok(never) => match never {},
        Err(e) => {
            eprintln!("softverbs-run: {e}");
            let code = match e {
                softverbs::launcher::LaunchError::Usage => 2,
                softverbs::launcher::LaunchError::Os { ref what, .. }
                    if what.starts_with("exec") =>
                {
                    127
                }
                _ => 1,
            };
            std::process::exit(code);
        }
    }
}
