package idempotency

import (
	"bytes"
	"crypto/sha256"
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

// Version 5 of the fingerprint format (see fingerprint.go) identifies an
// HTTP request:
//
//	request    32 bytes: SHA-256 of the method, the target and the host the
//	           client sent (lower case), and the Content-Type (its media
//	           type and parameters but a multipart boundary), each
//	           length-prefixed
//	flags      1 byte: 1 the form's digest follows, 2 the body's, 4 (with
//	           2) the body's digest is of its canonical JSON
//	form       32 bytes: SHA-256 of the form's fields (url.Values.Encode:
//	           names sorted, values in order) and, for a multipart form,
//	           each file in field order: field, name, type, SHA-256 of the
//	           content
//	body       32 bytes: SHA-256 of the body's bytes; with flag 4, of its
//	           canonical JSON (see jsonDigest)
//	bytes      with flag 4 only, 32 bytes: SHA-256 of the body's bytes, as
//	           version 4 had it, to compare with a row of that release
//
// A body has a form digest when net/http would parse it as a form (its
// Content-Type, read as ParseForm reads it; a multipart body that does not
// parse has the digest of one that does not), and a body digest when its
// bytes were there to read: a middleware in front that parsed the form
// (r.ParseForm, r.PostFormValue, r.ParseMultipartForm; CSRF middleware
// does, on some requests and not on others) consumed them. A body whose
// media type is JSON (isJSONType) and that is one JSON value is digested
// as its canonical JSON, so that whitespace, the order of an object's keys
// and the escaping of a string do not count; any other body, and a JSON
// one that does not parse, by its bytes. Two requests are the same when
// their requests agree and, when both have a body digest, their bodies (of
// one kind: under one Content-Type, a body that parses as JSON is never
// the same as one that does not); else their forms. So a form is the same
// request parsed in front or not, while two bodies the handler could read
// differently (JSON sent as a form, "a+b" and "a b") are never one.
//
// Version 4, the release before, is version 5 without flag 4 (and without
// the bytes' digest): a JSON body was digested by its bytes. A row it
// stored is compared with a version 5 fingerprint as version 4 compared
// two (sameHTTPAcross): the same request and body bytes, or form; one
// that does not parse as version 4 is the same request as nothing
// (malformedHTTP).
const (
	httpVersion   = 5
	httpVersion4  = 4 // read only, to tell a damaged row
	httpHeadLen   = len(fingerprintMagic) + 1 + sha256.Size + 1
	httpHasForm   = 1
	httpHasBody   = 2
	httpJSONBody  = 4
	httpFlagsMask = httpHasForm | httpHasBody | httpJSONBody
)

// httpFingerprint returns the fingerprint of r, whose target is as the
// client sent it and body what was left to read of it. A form parsed in
// front is held to the body's limit too (413), so that a request gets one
// answer whether or not something in front parsed it: by the length the
// client declared (readBody refused one over the limit), or without one by
// the size of its fields and files, which is what an unparsed form sent
// without a length is held to as well.
func httpFingerprint(r *http.Request, target string, body []byte, limit int64) ([]byte, int, error) {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		ct = "application/octet-stream" // as ParseForm
	}
	// As ParseForm reads the type: a malformed parameter does not keep it
	// from being a form's type.
	mediaType, params, typeErr := mime.ParseMediaType(ct)
	h := sha256.New()
	writeParts(h, []byte(r.Method), []byte(target), []byte(strings.ToLower(r.Host)), []byte(contentType(ct, mediaType, params, typeErr)))
	out := append([]byte(fingerprintMagic), httpVersion)
	out = h.Sum(out)
	flags := len(out)
	out = append(out, 0)

	isForm := mediaType == "application/x-www-form-urlencoded" || mediaType == "multipart/form-data"
	// Consumed: a middleware in front parsed the form, reading the body.
	// (ParseForm leaves any other body unread.)
	consumed := len(body) == 0 && (r.MultipartForm != nil || (r.PostForm != nil && isForm))
	var form *formSum
	if consumed || isForm {
		var err error
		if form, err = formDigest(r, body, consumed, mediaType, params, typeErr); err != nil {
			return nil, http.StatusInternalServerError, err
		}
	}
	if form != nil && r.ContentLength < 0 && form.size > limit {
		return nil, http.StatusRequestEntityTooLarge, errTooLarge(limit)
	}
	if form != nil {
		out[flags] |= httpHasForm
		out = append(out, form.sum[:]...)
	}
	if !consumed {
		out[flags] |= httpHasBody
		sum, canonical := bodyDigest(mediaType, params, body)
		out = append(out, sum[:]...)
		if canonical {
			out[flags] |= httpJSONBody
			raw := sha256.Sum256(body)
			out = append(out, raw[:]...)
		}
	}
	return out, 0, nil
}

// bodyDigest is the digest of a body read whole: of its canonical JSON when
// its media type is JSON in UTF-8 (no charset, which RFC 8259 makes UTF-8,
// or charset utf-8: the canonical form reads the bytes as UTF-8, and a
// handler that honours another charset would read them otherwise) and it
// is one JSON value (canonical), else of its bytes.
func bodyDigest(mediaType string, params map[string]string, body []byte) (sum [sha256.Size]byte, canonical bool) {
	if cs, ok := params["charset"]; isJSONType(mediaType) && (!ok || strings.EqualFold(cs, "utf-8") || strings.EqualFold(cs, "utf8")) {
		if sum, ok := jsonDigest(body); ok {
			return sum, true
		}
	}
	return sha256.Sum256(body), false
}

// contentType is the request's Content-Type as it bears on the body's
// meaning: its media type and parameters, but for a multipart boundary,
// which changes with every encoding of the same form.
func contentType(raw, mediaType string, params map[string]string, err error) string {
	if err == nil {
		delete(params, "boundary")
		if t := mime.FormatMediaType(mediaType, params); t != "" {
			return t
		}
	}
	return strings.ToLower(strings.TrimSpace(raw))
}

// errTooLarge is the error of a body over the limit.
func errTooLarge(limit int64) error {
	return status.Errorf(codes.InvalidArgument, "idempotency: the request body is over %d bytes, the most that can be fingerprinted", limit)
}

// readLimit is how much of the body the middleware reads: the limit, or
// for a form sent without a length, which is held to the limit by the size
// of its fields and files (see httpFingerprint), as much as net/http's
// ParseForm reads of one.
func readLimit(r *http.Request, limit int64) int64 {
	if r.ContentLength >= 0 {
		return limit
	}
	mediaType, _, _ := mime.ParseMediaType(r.Header.Get("Content-Type"))
	if mediaType == "application/x-www-form-urlencoded" || mediaType == "multipart/form-data" {
		return max(limit, maxFormBytes)
	}
	return limit
}

// maxFormBytes is what net/http's ParseForm reads of a form at most.
const maxFormBytes = 10 << 20

// formSum identifies a form: the digest of its fields and files, and
// their size.
type formSum struct {
	sum  [sha256.Size]byte
	size int64
}

// formDigest identifies the request's form: from what a middleware in
// front parsed (consumed), or from the body's bytes, parsed as net/http
// parses them. A multipart body that does not parse is identified as
// such, parsed in front or not (the handler sees no form either way).
func formDigest(r *http.Request, body []byte, consumed bool, mediaType string, params map[string]string, typeErr error) (*formSum, error) {
	switch {
	case consumed && r.MultipartForm != nil:
		return multipartDigest(r.MultipartForm)
	case mediaType == "application/x-www-form-urlencoded":
		fields := r.PostForm
		if !consumed {
			// What parsed before an invalid pair, as ParseForm keeps it.
			fields, _ = url.ParseQuery(string(body))
		}
		enc := fields.Encode()
		return &formSum{sha256.Sum256([]byte("form\x00" + enc)), int64(len(enc))}, nil
	case !consumed && typeErr == nil && params["boundary"] != "":
		// The files stay in memory: the body is within its limit.
		form, err := multipart.NewReader(bytes.NewReader(body), params["boundary"]).ReadForm(int64(len(body)) + 1)
		if err == nil {
			defer func() { _ = form.RemoveAll() }()
			return multipartDigest(form)
		}
	}
	return &formSum{sha256.Sum256([]byte("multipart that does not parse")), int64(len(body))}, nil
}

// multipartDigest is the digest of a multipart form: its fields, then each
// file in field order, by field, name, type and content.
func multipartDigest(form *multipart.Form) (*formSum, error) {
	h := sha256.New()
	values := url.Values(form.Value).Encode()
	h.Write([]byte("multipart\x00" + values))
	size := int64(len(values))
	for _, field := range slices.Sorted(maps.Keys(form.File)) {
		for _, fh := range form.File[field] {
			f, err := fh.Open()
			if err != nil {
				return nil, status.Errorf(codes.Internal, "idempotency: reading the file %q of the parsed multipart form: %v", fh.Filename, err)
			}
			content := sha256.New()
			_, err = io.Copy(content, f)
			_ = f.Close()
			if err != nil {
				return nil, status.Errorf(codes.Internal, "idempotency: reading the file %q of the parsed multipart form: %v", fh.Filename, err)
			}
			size += fh.Size
			writeParts(h, []byte(field), []byte(fh.Filename), []byte(fh.Header.Get("Content-Type")), content.Sum(nil))
		}
	}
	f := &formSum{size: size}
	h.Sum(f.sum[:0])
	return f, nil
}

// malformedHTTP reports whether fp carries the tag of version 5 or 4 but
// not its form: a damaged row, which is the same request as nothing.
func malformedHTTP(fp []byte) bool {
	tag := len(fingerprintMagic) + 1
	if len(fp) < tag || string(fp[:len(fingerprintMagic)]) != fingerprintMagic {
		return false
	}
	v := fp[tag-1]
	return (v == httpVersion || v == httpVersion4) && !validHTTP(fp)
}

// validHTTP reports whether fp is a well-formed fingerprint of version 5,
// or of version 4 (which has no flag 4).
func validHTTP(fp []byte) bool {
	if len(fp) < httpHeadLen {
		return false
	}
	flags, known := fp[httpHeadLen-1], byte(httpFlagsMask)
	if fp[len(fingerprintMagic)] == httpVersion4 {
		known = httpHasForm | httpHasBody
	}
	n := 0
	for _, f := range []byte{httpHasForm, httpHasBody} {
		if flags&f != 0 {
			n++
		}
	}
	if flags&httpJSONBody != 0 {
		n++ // the bytes' digest
	}
	jsonWithoutBody := flags&httpJSONBody != 0 && flags&httpHasBody == 0
	return flags&^known == 0 && !jsonWithoutBody && len(fp) == httpHeadLen+n*sha256.Size
}

// httpPart is the digest of a well-formed HTTP fingerprint of version 4 or
// 5 named by which (httpHasForm, httpHasBody, or httpJSONBody for a body's
// bytes, which version 5 keeps beside its canonical JSON), nil if it has
// none.
func httpPart(fp []byte, which byte) []byte {
	flags, rest := fp[httpHeadLen-1], fp[httpHeadLen:]
	bytesOf := which == httpJSONBody
	if bytesOf {
		if flags&httpJSONBody == 0 {
			which = httpHasBody // the body's digest is of its bytes
		} else {
			return rest[len(rest)-sha256.Size:]
		}
	}
	if flags&which == 0 {
		return nil
	}
	if which == httpHasBody && flags&httpHasForm != 0 {
		rest = rest[sha256.Size:]
	}
	return rest[:sha256.Size]
}

// sameHTTPAcross compares a version 4 fingerprint with a version 5 one as
// version 4 compared two: the same request, and the same body bytes when
// both have a body digest, else the same form.
func sameHTTPAcross(v4, v5 []byte) bool {
	tag := len(fingerprintMagic)
	if !bytes.Equal(v4[tag+1:httpHeadLen-1], v5[tag+1:httpHeadLen-1]) {
		return false
	}
	if a, b := httpPart(v4, httpJSONBody), httpPart(v5, httpJSONBody); a != nil && b != nil {
		return bytes.Equal(a, b)
	}
	a, b := httpPart(v4, httpHasForm), httpPart(v5, httpHasForm)
	return a != nil && b != nil && bytes.Equal(a, b)
}

// sameHTTP compares two version 5 fingerprints (see above).
func sameHTTP(stored, current []byte) bool {
	if !bytes.Equal(stored[:httpHeadLen-1], current[:httpHeadLen-1]) {
		return false
	}
	if a, b := httpPart(stored, httpHasBody), httpPart(current, httpHasBody); a != nil && b != nil {
		// A digest of canonical JSON is never one of bytes.
		return (stored[httpHeadLen-1]^current[httpHeadLen-1])&httpJSONBody == 0 && bytes.Equal(a, b)
	}
	a, b := httpPart(stored, httpHasForm), httpPart(current, httpHasForm)
	return a != nil && b != nil && bytes.Equal(a, b)
}
