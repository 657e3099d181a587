package idempotency

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"io"
	"maps"
	"mime"
	"mime/multipart"
	"net/http"
	"net/url"
	"slices"
	"strings"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Version 4 of the fingerprint format (see fingerprint.go) identifies an
// HTTP request:
//
//	request    32 bytes: SHA-256 of the method, the target and the host the
//	           client sent (lower case), each length-prefixed
//	flags      1 byte: 1 the form's digest follows, 2 the body's
//	form       32 bytes: SHA-256 of the form's fields (url.Values.Encode:
//	           names sorted, values in order) and, for a multipart form,
//	           each file in field order: field, name, type, SHA-256 of the
//	           content
//	body       32 bytes: SHA-256 of the body's bytes
//
// A body has a form digest when net/http would parse it as a form (its
// Content-Type, read as ParseForm reads it), and a body digest when its
// bytes were there to read: a middleware in front that parsed the form
// (r.ParseForm, r.PostFormValue, r.ParseMultipartForm; CSRF middleware
// does, on some requests and not on others) consumed them. Two requests
// are the same when their requests agree and, when both have a body
// digest, their bodies; else their forms. So a form is the same request
// parsed in front or not, while two bodies the handler could read
// differently (JSON sent as a form, "a+b" and "a b") are never one.
const (
	httpVersion   = 4
	httpHeadLen   = len(fingerprintMagic) + 1 + sha256.Size + 1
	httpHasForm   = 1
	httpHasBody   = 2
	httpFlagsMask = httpHasForm | httpHasBody
)

// httpFingerprint returns the fingerprint of r, whose target is as the
// client sent it and body what was left to read of it. A form parsed in
// front is held to the body's limit too (413), so that a request gets one
// answer whether or not something in front parsed it.
func httpFingerprint(r *http.Request, target string, body []byte, limit int64) ([]byte, int, error) {
	h := sha256.New()
	for _, p := range []string{r.Method, target, strings.ToLower(r.Host)} {
		h.Write(binary.AppendUvarint(nil, uint64(len(p))))
		h.Write([]byte(p))
	}
	out := append([]byte(fingerprintMagic), httpVersion)
	out = h.Sum(out)
	flags := len(out)
	out = append(out, 0)

	consumed := len(body) == 0 && (r.PostForm != nil || r.MultipartForm != nil)
	if consumed && parsedSize(r) > limit {
		return nil, http.StatusRequestEntityTooLarge, status.Errorf(codes.InvalidArgument,
			"idempotency: the request body is over %d bytes, the most that can be fingerprinted", limit)
	}
	form, hasForm, err := formDigest(r, body, consumed)
	if err != nil {
		return nil, http.StatusInternalServerError, err
	}
	if hasForm {
		out[flags] |= httpHasForm
		out = append(out, form[:]...)
	}
	if !consumed {
		out[flags] |= httpHasBody
		sum := sha256.Sum256(body)
		out = append(out, sum[:]...)
	}
	return out, 0, nil
}

// parsedSize is the size of a body a middleware in front parsed: the
// length the client declared, or without one what the form holds.
func parsedSize(r *http.Request) int64 {
	if r.ContentLength >= 0 {
		return r.ContentLength
	}
	n := int64(len(r.PostForm.Encode()))
	if r.MultipartForm != nil {
		for _, files := range r.MultipartForm.File {
			for _, fh := range files {
				n += fh.Size
			}
		}
	}
	return n
}

// formDigest returns the digest of the request's form when net/http would
// parse its body as one: from what a middleware in front parsed
// (consumed), or from the body's bytes, parsed as net/http parses them.
func formDigest(r *http.Request, body []byte, consumed bool) (d [sha256.Size]byte, ok bool, err error) {
	// As ParseForm: a malformed parameter does not keep the type from
	// being a form's; a multipart body needs a valid type and boundary.
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		ct = "application/octet-stream"
	}
	mediaType, params, typeErr := mime.ParseMediaType(ct)
	switch {
	case consumed && r.MultipartForm != nil:
		return multipartDigest(r.MultipartForm)
	case consumed:
		if mediaType != "application/x-www-form-urlencoded" {
			return d, false, nil
		}
		return sha256.Sum256([]byte("form\x00" + r.PostForm.Encode())), true, nil
	case mediaType == "application/x-www-form-urlencoded":
		// What parsed before an invalid pair, as ParseForm keeps it.
		fields, _ := url.ParseQuery(string(body))
		return sha256.Sum256([]byte("form\x00" + fields.Encode())), true, nil
	case typeErr == nil && mediaType == "multipart/form-data" && params["boundary"] != "":
		// The files stay in memory: the body is within its limit.
		form, err := multipart.NewReader(bytes.NewReader(body), params["boundary"]).ReadForm(int64(len(body)) + 1)
		if err != nil {
			return d, false, nil // the handler's parse fails too
		}
		defer func() { _ = form.RemoveAll() }()
		return multipartDigest(form)
	}
	return d, false, nil
}

// multipartDigest is the digest of a multipart form: its fields, then each
// file in field order, by field, name, type and content.
func multipartDigest(form *multipart.Form) (d [sha256.Size]byte, ok bool, err error) {
	h := sha256.New()
	h.Write([]byte("multipart\x00" + url.Values(form.Value).Encode()))
	for _, field := range slices.Sorted(maps.Keys(form.File)) {
		for _, fh := range form.File[field] {
			f, err := fh.Open()
			if err != nil {
				return d, false, status.Errorf(codes.Internal, "idempotency: reading the file %q of the parsed multipart form: %v", fh.Filename, err)
			}
			content := sha256.New()
			_, err = io.Copy(content, f)
			_ = f.Close()
			if err != nil {
				return d, false, status.Errorf(codes.Internal, "idempotency: reading the file %q of the parsed multipart form: %v", fh.Filename, err)
			}
			for _, p := range [][]byte{[]byte(field), []byte(fh.Filename), []byte(fh.Header.Get("Content-Type")), content.Sum(nil)} {
				h.Write(binary.AppendUvarint(nil, uint64(len(p))))
				h.Write(p)
			}
		}
	}
	h.Sum(d[:0])
	return d, true, nil
}

// validHTTP reports whether fp is a well-formed version 4 fingerprint.
func validHTTP(fp []byte) bool {
	if len(fp) < httpHeadLen {
		return false
	}
	flags := fp[httpHeadLen-1]
	n := 0
	for _, f := range []byte{httpHasForm, httpHasBody} {
		if flags&f != 0 {
			n++
		}
	}
	return flags&^httpFlagsMask == 0 && len(fp) == httpHeadLen+n*sha256.Size
}

// sameHTTP compares two version 4 fingerprints (see above).
func sameHTTP(stored, current []byte) bool {
	if !bytes.Equal(stored[:httpHeadLen-1], current[:httpHeadLen-1]) {
		return false
	}
	part := func(fp []byte, which byte) []byte {
		flags, rest := fp[httpHeadLen-1], fp[httpHeadLen:]
		if flags&which == 0 {
			return nil
		}
		if which == httpHasBody && flags&httpHasForm != 0 {
			rest = rest[sha256.Size:]
		}
		return rest[:sha256.Size]
	}
	if a, b := part(stored, httpHasBody), part(current, httpHasBody); a != nil && b != nil {
		return bytes.Equal(a, b)
	}
	a, b := part(stored, httpHasForm), part(current, httpHasForm)
	return a != nil && b != nil && bytes.Equal(a, b)
}
