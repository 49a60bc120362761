<#
.SYNOPSIS
Install mlight for this user on Windows: an isolated environment made by uv, holding the build of torch
that fits this machine (the CUDA build the NVIDIA driver runs, or the CPU build without an NVIDIA GPU),
then mlight; `mlight` and `mlight-app` go on PATH.

.DESCRIPTION
The torch choice is packaging/torch_choice.py (tested with fake nvidia-smi outputs; this script finds it
beside itself or fetches it from $env:MLIGHT_INSTALL_BASE). Uninstall: uv tool uninstall mlight

.EXAMPLE
powershell -ExecutionPolicy ByPass -c "irm https://raw.githubusercontent.com/mlight-project/mlight/main/packaging/install.ps1 | iex"

.EXAMPLE
& ([scriptblock]::Create((irm https://raw.githubusercontent.com/mlight-project/mlight/main/packaging/install.ps1))) -Cuda 12.8

.EXAMPLE
.\packaging\install.ps1 -Cpu -DryRun
#>
param(
    # the CPU build of torch, even with an NVIDIA GPU
    [switch]$Cpu,
    # this CUDA build of torch (12.6, 12.8, 13.0, ...), whatever the driver says
    [string]$Cuda = $env:MLIGHT_CUDA,
    # Python for mlight's environment (uv fetches it when missing)
    [string]$Python = "3.12",
    # what to install: mlight==0.1.0, a wheel file, a source folder
    [string]$From = "mlight",
    # say what would be installed and the commands, change nothing
    [switch]$DryRun
)

# Errors are thrown, never `exit`: run through `irm | iex`, exit would close the user's PowerShell window.
function Install-Mlight {
    $ErrorActionPreference = "Continue"  # native tools' stderr is information here, not an error
    $base = if ($env:MLIGHT_INSTALL_BASE) { $env:MLIGHT_INSTALL_BASE } else {
        "https://raw.githubusercontent.com/mlight-project/mlight/main/packaging" }

    # ---- uv --------------------------------------------------------------------------------------
    $uv = Find-Uv
    if (-not $uv) {
        if ($DryRun) {
            Write-Host "would install uv (Astral's installer, into ~\.local\bin)"
        } else {
            Write-Host "installing uv (Astral's installer, into ~\.local\bin) ..."
            powershell -NoProfile -ExecutionPolicy ByPass -c "irm https://astral.sh/uv/install.ps1 | iex"
            $uv = Find-Uv
            if (-not $uv) { throw "uv was installed but cannot be found: open a new terminal and run this again" }
        }
    }

    # ---- which torch -------------------------------------------------------------------------------
    $chooser = if ($PSScriptRoot) { Join-Path $PSScriptRoot "torch_choice.py" } else { "" }
    if (-not $chooser -or -not (Test-Path $chooser)) {  # run through iex: fetch it from where this came from
        $chooser = Join-Path ([IO.Path]::GetTempPath()) "mlight-torch-choice.py"
        Invoke-WebRequest -UseBasicParsing -Uri "$base/torch_choice.py" -OutFile $chooser
    }
    $choiceArgs = @("--system", "windows")
    if ($Cpu) { $choiceArgs += "--cpu" } elseif ($Cuda) { $choiceArgs += @("--cuda", $Cuda) }
    $py = Find-Python  # @(exe, its arguments)
    if ($py) {
        $pyExe = $py[0]
        $pyArgs = @($py | Select-Object -Skip 1)
        $backend = & $pyExe @pyArgs $chooser @choiceArgs
    } elseif ($uv) {
        $backend = & $uv run --no-project --quiet --python $Python -- python $chooser @choiceArgs
    } else {
        throw "no Python here to decide which torch to install (and no uv yet): install uv or Python first"
    }
    if ($LASTEXITCODE -ne 0) { throw "could not decide which torch build to install (see above)" }
    $backend = "$backend".Trim()

    # ---- install -------------------------------------------------------------------------------
    $cmd = @("tool", "install", "--force", "--python", $Python)
    if ($backend -ne "default") { $cmd += @("--torch-backend", $backend) }
    $cmd += @("--reinstall-package", "torch", $From)
    if ($DryRun) {
        Write-Host "would install: $From with torch's $backend build, Python $Python, in its own environment"
        Write-Host "would run:     uv $($cmd -join ' ')"
        Write-Host "would run:     uv tool update-shell   (puts mlight and mlight-app on PATH)"
        return
    }
    if (-not ((& $uv tool install --help) -match "--torch-backend")) {
        throw "this uv ($(& $uv --version)) is too old to choose torch builds: run 'uv self update' and try again"
    }
    Write-Host "installing $From (torch: $backend) ..."
    & $uv @cmd
    if ($LASTEXITCODE -ne 0) { throw "uv could not install $From (see above)" }

    $bin = "$(& $uv tool dir --bin)".Trim()
    $onPath = ($env:Path -split ";") -contains $bin
    if (-not $onPath) {
        & $uv tool update-shell | Out-Null  # the user's PATH, for new terminals
        $env:Path = "$bin;$env:Path"
    }
    & (Join-Path $bin "mlight.exe") --version
    if ($LASTEXITCODE -ne 0) { throw "mlight was installed into $bin but does not start" }
    Write-Host ""
    Write-Host "mlight is installed."
    if (-not $onPath) { Write-Host "Open a new terminal first (this one has it already), then:" }
    Write-Host "  mlight-app                                       the app, on the built-in demo model"
    Write-Host "  mlight run --prompts demo --out results.jsonl    the same, headless"
    Write-Host "  mlight --help                                    everything else"
    Write-Host "The app looks best in Windows Terminal. Uninstall: uv tool uninstall mlight"
}

function Find-Uv {
    $cmd = Get-Command uv -ErrorAction SilentlyContinue
    if ($cmd) { return $cmd.Source }
    $local = Join-Path $env:USERPROFILE ".local\bin\uv.exe"
    if (Test-Path $local) { return $local }
    return $null
}

function Find-Python {
    # the py launcher, or a real python.exe; not the Microsoft Store's placeholder in WindowsApps
    $launcher = Get-Command py -ErrorAction SilentlyContinue
    if ($launcher) { return @($launcher.Source, "-3") }
    $cmd = Get-Command python -ErrorAction SilentlyContinue
    if ($cmd -and $cmd.Source -notlike "*\WindowsApps\*") { return @($cmd.Source) }
    return $null
}

Install-Mlight
