"""The review of every metric and getter OSWorld's wheel exports: what each does with the
agent's files, and so whether it may run on the host.

Metrics run in a child process of the env worker, outside the desktop's sandbox, on what
the agent made (envmanager.osworld_metric_process: memory, CPU, file-size and wall-clock
limits, a private scratch directory as working directory and TMPDIR). Each metric
`metrics/__init__.py` exports (desktop-env 1.0.2) was read line by line, with the helpers
it calls, and is one of:

- SAFE_METRICS: compares values, or reads the fetched files with data-only parsers
  (python-docx, python-pptx, openpyxl, odfpy, pypdf, PyMuPDF, pdfplumber, mutagen, lxml 6
  and expat without external entities, Pillow, OpenCV's imread, librosa through libsndfile,
  json, csv, re, rapidfuzz) and writes, imports, evaluates and runs nothing;
- SCRATCH_METRICS: also writes files (a temp.pdf in its working directory, an unpacked
  archive or a copy next to the fetched file in the env's cache directory) or may run a
  fixed program on the file: safe in the scratch directory, under the file-size limit, and
  with tar members kept inside their folder (`harden`);
- REFUSED_METRICS: runs, evaluates or writes what the agent controls where the limits do
  not reach, or cannot score at all; the importer refuses a task that names one, with
  the reason, and the evaluator refuses it again.

Four library defaults would let a data-only parser reach the host; `harden()`, run in the
metric process before any metric, turns them off: Pillow's EPS plugin (an image that
starts with `%!PS` is handed to Ghostscript, which interprets the agent's PostScript),
tldextract's default extractor (downloads the public suffix list and writes it under
$HOME on first use: the bundled snapshot is used instead), the FFmpeg inside OpenCV (a
"video" that is an HLS playlist makes it fetch the URLs listed: only local files are
opened) and tarfile's unfiltered extraction (`shutil.unpack_archive` of a tar would follow
absolute paths, `..` and links: the `data` filter keeps members inside their folder).

Getters run in the env worker itself (they talk to the VM); REFUSED_GETTERS are those that
read host files a task names or parse the agent's file in the worker, outside the limits.
A metric or getter no review covers (a newer wheel's) is refused as not reviewed.
"""

from __future__ import annotations

import os

SAFE_METRICS = frozenset(
    {
        # metrics.basic_os
        "check_moved_jpgs",
        "check_text_enlarged",
        "is_in_vm_clickboard",
        "is_utc_0",
        # metrics.chrome (dicts and URLs a getter returned; PyMuPDF text; BeautifulSoup)
        "check_enabled_experiments",
        "check_font_size",
        "check_history_deleted",
        "compare_htmls",
        "compare_pdfs",
        "is_added_to_steam_cart",
        "is_cookie_deleted",
        "is_expected_active_tab",
        "is_expected_active_tab_approximate",
        "is_expected_bookmarks",
        "is_expected_installed_extensions",
        "is_expected_search_query",
        "is_expected_tabs",
        "is_expected_url_pattern_match",
        "is_shortcut_on_desktop",
        # metrics.docs (python-docx, odfpy, xml.etree on the fetched files)
        "check_highlighted_words",
        "check_italic_font_size_14",
        "check_no_duplicates",
        "check_tabstops",
        "compare_contains_image",
        "compare_docx_files",
        "compare_docx_files_and_ignore_new_lines",
        "compare_docx_images",
        "compare_docx_lines",
        "compare_docx_tables",
        "compare_font_names",
        "compare_highlighted_text",
        "compare_init_lines",
        "compare_insert_equation",
        "compare_line_spacing",
        "compare_references",
        "compare_subscript_contains",
        "compare_unique_train_records",
        "contains_page_break",
        "evaluate_alignment",
        "evaluate_colored_words_in_tables",
        "evaluate_conversion",
        "evaluate_spacing",
        "evaluate_strike_through_last_paragraph",
        "find_default_font",
        "has_page_numbers_in_footers",
        "is_first_line_centered",
        # metrics.general
        "check_accessibility_tree",
        "check_csv",
        "check_direct_json_object",
        "check_include_exclude",
        "check_json",
        "check_line_number",
        "check_list",
        "compare_python_pure_text",
        "compare_terminal_and_txt",
        "compare_time_in_speedtest_results",
        "diff_text_file",
        "exact_match",
        "file_contains",
        "fuzzy_match",
        "fuzzy_place_math",
        "is_gold_text_included_in_pdf",
        "is_in_list",
        "is_included_all_json_objects",
        "literal_match",
        "match_in_list",
        # metrics.gimp (Pillow, OpenCV's imread, scikit-image on the fetched images)
        "check_brightness_decrease_and_structure_sim",
        "check_config_status",
        "check_contrast_increase_and_structure_sim",
        "check_file_exists_and_structure_sim",
        "check_green_background",
        "check_image_file_size",
        "check_image_mirror",
        "check_image_size",
        "check_palette_and_structure_sim",
        "check_saturation_increase_and_structure_sim",
        "check_sharper",
        "check_structure_sim",
        "check_structure_sim_resized",
        "check_textbox_on_leftside",
        "check_triangle_position",
        "compare_image_list",
        "compare_triangle_positions",
        "decrease_brightness",
        "increase_saturation",
        # metrics.libreoffice, others, pdf
        "check_libre_locale",
        "check_mp3_meta",
        "check_pdf_pages",
        # metrics.slides (python-pptx, xml.etree)
        "check_auto_saving_time",
        "check_image_stretch_and_center",
        "check_left_panel",
        "check_page_number_colors",
        "check_presenter_console_disable",
        "check_slide_numbers_color",
        "check_slide_orientation_Portrait",
        "check_strikethrough",
        "check_transition",
        "compare_pptx_files",
        "evaluate_presentation_fill_to_rgb_distance",
        # metrics.table (openpyxl and pandas: formulas are read as text, never evaluated)
        "compare_conference_city_in_order",
        "compare_csv",
        "compare_table",
        # metrics.thunderbird
        "check_thunderbird_filter",
        "check_thunderbird_prefs",
        # metrics.vlc (vlcrc text, VLC's status XML, Pillow, OpenCV's VideoCapture)
        "check_global_key_play_pause",
        "check_one_instance_when_started_from_file",
        "check_qt_bgcone",
        "check_qt_max_volume",
        "check_qt_minimal_view",
        "check_qt_slider_colours",
        "compare_images",
        "compare_videos",
        "is_vlc_fullscreen",
        "is_vlc_playing",
        "is_vlc_recordings_folder",
        # metrics.vscode
        "check_html_background_image",
        "check_json_keybindings",
        "check_json_settings",
        "compare_answer",
        "compare_config",
        "compare_result_files",
        "compare_text_file",
        "is_extension_installed",
    }
)
SCRATCH_METRICS = {
    "compare_archive": (
        "unpacks both archives next to the fetched files (in the env's cache directory) with "
        "shutil.unpack_archive, tar members kept inside their folder"
    ),
    "compare_audios": (
        "decodes with libsndfile; on a format it lacks, audioread runs ffmpeg on the file "
        "where ffmpeg is installed"
    ),
    "compare_pdf_images": (
        "copies both PDFs into a temp_pdf_comparison folder next to them (the env's cache "
        "directory) and decodes their images with Pillow"
    ),
    "compare_zip_files": (
        "reads both zip files in memory and writes each PDF in them to temp.pdf in its "
        "working directory (compare_pdf_content)"
    ),
    "run_sqlite3": (
        "runs the task's SQL on the agent's database file with sqlite3 (no extensions load; "
        "the CPU limit ends a runaway query)"
    ),
}
REFUSED_METRICS = {
    "check_python_file_by_test_suite": (
        "it imports a Python test file with exec_module and calls its test function in the "
        "metric process, outside the sandbox, with the test file's directory (where the "
        "agent's files are) put first on sys.path: the agent's code would run on the host"
    ),
    "check_python_file_by_gold_file": (
        "its body is `pass` in desktop-env 1.0.2: it scores nothing (every call would fail)"
    ),
    "check_gnome_favorite_apps": (
        "it runs eval() on the favourite-apps text fetched from the desktop, which the agent "
        "controls: the agent's text would run as Python on the host"
    ),
    "compare_epub": (
        "it writes each .html member of the agent's epub to os.path.join(<a folder next to "
        "the file>, <the member's name>): a member named with '..' or an absolute path "
        "writes anywhere on the host"
    ),
    "compare_image_text": (
        "it runs easyocr, which Dartboard does not install (it needs torchvision) and which "
        "downloads its model weights from the internet on first use"
    ),
    "check_thunderbird_folder": (
        "it is broken in desktop-env 1.0.2: it skips every non-empty message and splits on "
        "'FROM - ' (mbox writes 'From - '), so it scores 1.0 for almost any file"
    ),
    "check_file_exists": (
        "it checks a path on the evaluating host, not on the desktop: it cannot score the "
        "task, and it tells the agent which host files exist"
    ),
    "get_unique_train_ids": (
        "it is a helper, not a metric: it returns a (set, count) pair, not a score"
    ),
}
REFUSED_GETTERS = {
    "content_from_vm_file": (
        "it parses the agent's xlsx with pandas in the env worker itself, outside the "
        "metric process's memory and time limits"
    ),
    "conference_city_in_order": (
        "it reads the host file the task names as csv_path (any path on the env worker's host)"
    ),
}
NOT_REVIEWED = (
    "it is not among the metrics reviewed for running on the host "
    "(envmanager.osworld_metric_review); metrics run outside the desktop's sandbox"
)
_hardened = False


def metric_refusal(name: str) -> str | None:
    """Why metric `name` may not run here; None for a reviewed safe or scratch one."""
    if name in SAFE_METRICS or name in SCRATCH_METRICS:
        return None
    return REFUSED_METRICS.get(name, NOT_REVIEWED)


def getter_review_refusal(name: str) -> str | None:
    """Why getter `name` (a task's getter type) may not run here; None if it may."""
    why = REFUSED_GETTERS.get(name)
    return f"getter {name!r} is refused: {why}" if why else None


def harden() -> None:
    """Turn off the library defaults that reach past a data-only parser (module docstring).
    Called in the metric process before any metric runs; idempotent."""
    global _hardened
    if _hardened:
        return
    # Imported here for start-up cost: only the metric process needs them.
    import tarfile

    import tldextract
    from PIL import Image

    Image.init()  # registers every plugin now, so a later init() cannot bring EPS back
    Image.OPEN.pop("EPS", None)
    if "EPS" in Image.ID:
        Image.ID.remove("EPS")
    tldextract.tldextract.TLD_EXTRACTOR = tldextract.TLDExtract(
        suffix_list_urls=(), cache_dir=None, fallback_to_snapshot=True
    )
    os.environ["OPENCV_FFMPEG_CAPTURE_OPTIONS"] = "protocol_whitelist;file"
    # shutil.unpack_archive extracts with filter=None, which falls back to this attribute.
    tarfile.TarFile.extraction_filter = staticmethod(tarfile.data_filter)
    _hardened = True
