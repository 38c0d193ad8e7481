"""python -m dsacp run|replay|make-case ...: the dsacp command-line tool shipped in the package."""
import os
import sys


def main():
    exe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "dsacp")
    if not os.path.exists(exe):
        sys.exit(f"dsacp: the command-line tool is not in this installation ({exe} is missing)")
    os.execv(exe, [exe] + sys.argv[1:])


if __name__ == "__main__":
    main()
